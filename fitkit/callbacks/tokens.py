"""``TokensSeen``: the input tokens a run has trained on (the Trainer's ``include_num_input_tokens_seen``).

A language model's progress is often told in tokens: the count goes into the epoch logs (and
so History, CSV, TensorBoard and every logger) as ``num_input_tokens_seen``, the Trainer's key,
and into checkpoints, so a resumed run goes on counting from where the checkpoint was taken.
"""

from __future__ import annotations

from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.callbacks.throughput import token_count
from fitkit.checks import check_bool
from fitkit.checks.declared import Option, declare, declared
from fitkit.distributed import all_reduce_sum, is_distributed

__all__ = ["TokensSeen"]


_TOKENS_SEEN_OPTIONS = declare(
    "TokensSeen",
    Option("non_padding", "bool"),
)


class TokensSeen(Callback):
    """Count the input tokens of the training batches, over all ranks, and log the total.

    A batch's tokens are ``B * T`` of its integer ``(B, T)`` input (a dict's ``input_ids``
    first; the Trainer's default), or, with ``non_padding=True``, the ones of its
    ``attention_mask`` (the Trainer's ``"non_padding"``). Every training batch counts, micro-batches
    of an accumulation window included. Under torchrun each step adds one all-reduce of one
    number (as the Trainer gathers the count each step); the count stays on the device and is
    read on the host once per epoch, and when a checkpoint is written.

    Logs: ``num_input_tokens_seen`` in the epoch logs (the total since the run's first step).
    State: the total, in checkpoints (``BackupAndRestore``, ``save_checkpoint``).

    Args:
        non_padding: count ``attention_mask`` ones instead of ``B * T``.

    Raises:
        ValueError: at the first batch, when the batch has no token input (no integer
            ``(B, T)`` tensor, no ``input_ids``), or no ``attention_mask`` with ``non_padding``.

    Example:
        >>> import fitkit
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
        >>> model = fitkit.Model(net, device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(torch.zeros(10, 3, dtype=torch.long), torch.zeros(10, 1), batch_size=4,
        ...                     epochs=2, verbose=0, callbacks=[TokensSeen()])
        >>> history.history["num_input_tokens_seen"]  # 10 rows of 3 tokens per epoch
        [30, 60]
    """

    @declared(_TOKENS_SEEN_OPTIONS)
    def __init__(self, non_padding: bool = False):
        super().__init__()
        check_bool("non_padding", non_padding)
        self.non_padding = non_padding
        self._base = 0  # counted before this fit (a resumed run's checkpoint, or an earlier fit)
        self._seen: torch.Tensor | int = 0  # counted in this fit: a Python int, or a device tensor

    def _batch_tokens(self, x: Any) -> Any:
        if self.non_padding:
            mask = x.get("attention_mask") if isinstance(x, dict) else None
            if not isinstance(mask, torch.Tensor):
                raise ValueError(
                    "TokensSeen(non_padding=True) counts the ones of the batch's attention_mask, but the batch "
                    f"has none (inputs: {type(x).__name__}). Fix: yield dict batches with an 'attention_mask', "
                    "or count every position with TokensSeen()."
                )
            return mask.sum(dtype=torch.int64)  # on the device: no host read
        n = token_count(x)
        if n is None:
            raise ValueError(
                "TokensSeen counts the tokens of an integer (B, T) input (or a dict's 'input_ids'), but the "
                f"training batch has none (inputs: {type(x).__name__}). Fix: use it with token inputs, or drop it."
            )
        return n

    def on_train_begin(self, logs=None):
        self._seen = 0

    def on_train_batch_end(self, batch, logs=None):
        trained = self.model.train_batch
        if trained is None:
            return
        n = self._batch_tokens(trained[0])
        if is_distributed():
            t = n if isinstance(n, torch.Tensor) else torch.tensor(n, dtype=torch.int64, device=self.model.device)
            n = all_reduce_sum(t)
        self._seen = self._seen + n

    @property
    def value(self) -> int:
        """The tokens seen so far (a host read when the count is on the device)."""
        seen = self._seen
        return self._base + (int(seen.item()) if isinstance(seen, torch.Tensor) else seen)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["num_input_tokens_seen"] = self.value

    def on_train_end(self, logs=None):
        self._base, self._seen = self.value, 0  # a later fit of the same callback goes on counting

    def state_dict(self) -> dict[str, Any]:
        return {"num_input_tokens_seen": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._base, self._seen = int(state["num_input_tokens_seen"]), 0

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files.content import is_count, typed_problems

        return typed_problems(state, {"num_input_tokens_seen": (is_count, "an int >= 0")}, "its state")
