"""``NEFTune``: uniform noise on the input embeddings while training (the Trainer's ``neftune_noise_alpha``).

Source: Jain et al., "NEFTune: Noisy Embeddings Improve Instruction Finetuning" (2023),
Algorithm 1: in training, the embedding output ``E`` of shape ``(B, L, d)`` becomes
``E + U(-alpha / sqrt(L * d), alpha / sqrt(L * d))``, noise drawn afresh at every forward;
evaluation, prediction and validation see the plain embeddings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fitkit.callbacks.base import Callback
from fitkit.checks import check_number
from fitkit.checks.declared import Option, declare, declared

__all__ = ["NEFTune"]


_NEFTUNE_OPTIONS = declare(
    "NEFTune",
    Option("noise_alpha", "number", positive=True),
    Option("embedding", "custom", checked_in="NEFTune.on_train_begin", bad=(5,)),
)


class NEFTune(Callback):
    """Add NEFTune noise to the input embeddings during ``fit`` (training forwards only).

    The noise is drawn with ``Tensor.uniform_`` from the default generator of the embedding's device,
    so a seeded run repeats it, and a resumed run (whose checkpoint holds the RNG states) goes
    on with the noise it would have drawn. The hook is put on the embedding when ``fit`` starts
    and taken off when it ends (also when it raises), so ``evaluate`` / ``predict`` after ``fit``
    and the validations inside it use the plain embeddings (the module is in eval mode there).

    Args:
        noise_alpha: the paper's ``alpha`` (> 0; the paper and the Trainer use 5 to 15).
        embedding: the embedding module, or its name in ``model.module.named_modules()``.
            ``None``: the module's ``get_input_embeddings()`` (Hugging Face models), else its
            only ``nn.Embedding``.

    Raises:
        TypeError, ValueError: ``noise_alpha`` not a positive number (at construction);
            ``ValueError`` before step 1 when no embedding is found, the name is unknown, or
            the module has several ``nn.Embedding`` and no ``get_input_embeddings``.

    Example:
        >>> import fitkit
        >>> net = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 1))
        >>> model = fitkit.Model(net, device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> noise = NEFTune(noise_alpha=5.0)
        >>> _ = model.fit(torch.randint(0, 10, (8, 2)), torch.zeros(8, 1), batch_size=4, verbose=0,
        ...               callbacks=[noise])
        >>> noise.forwards, noise.bound  # 2 training forwards; alpha / sqrt(L * d) = 5 / sqrt(2 * 4)
        (2, 1.7677669529663687)
    """

    @declared(_NEFTUNE_OPTIONS)
    def __init__(self, noise_alpha: float = 5.0, embedding: nn.Module | str | None = None):
        super().__init__()
        check_number(
            "noise_alpha", noise_alpha, positive=True, fix="pass the paper's alpha, e.g. NEFTune(noise_alpha=5.0)."
        )
        if embedding is not None and not isinstance(embedding, (nn.Module, str)):
            raise TypeError(
                f"Expected `embedding` to be an nn.Module, a submodule's name or None. Received: "
                f"{type(embedding).__name__}. Fix: pass the embedding layer, or its name, e.g. 'wte'."
            )
        self.noise_alpha = float(noise_alpha)
        self.embedding = embedding
        self.forwards = 0  # training forwards that got noise in the last fit
        self.bound: float | None = None  # the last noise bound, alpha / sqrt(L * d)
        self._handle: Any = None
        self._target: nn.Module | None = None

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._target = self._find(model.module)  # before step 1: an error changes nothing

    def _find(self, module: nn.Module) -> nn.Module:
        if isinstance(self.embedding, nn.Module):
            if not any(m is self.embedding for m in module.modules()):
                raise ValueError(
                    f"NEFTune's `embedding` ({type(self.embedding).__name__}) is not a submodule of the model. "
                    "Fix: pass a layer of the module being trained, or its name."
                )
            return self.embedding
        names = dict(module.named_modules())
        if isinstance(self.embedding, str):
            if self.embedding not in names:
                close = [n for n in names if n and isinstance(names[n], nn.Embedding)]
                raise ValueError(
                    f"NEFTune's embedding={self.embedding!r} is not a submodule's name. Embeddings of this "
                    f"model: {close}. Fix: pass one of them."
                )
            return names[self.embedding]
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            found = getter()
            if isinstance(found, nn.Module):
                return found
        embeddings = [n for n, m in names.items() if isinstance(m, nn.Embedding)]
        if len(embeddings) != 1:
            raise ValueError(
                f"NEFTune needs the input embedding, but the model has {len(embeddings)} nn.Embedding modules "
                f"({embeddings}) and no get_input_embeddings(). Fix: pass NEFTune(embedding='name')."
            )
        return names[embeddings[0]]

    def on_train_begin(self, logs=None):
        self.forwards, self.bound = 0, None
        if self._target is None:
            self._target = self._find(self.model.module)
        self._handle = self._target.register_forward_hook(self._add_noise)

    def _add_noise(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or not isinstance(output, torch.Tensor) or output.dim() < 2:
            return None
        length, dim = (output.shape[-2], output.shape[-1]) if output.dim() >= 3 else (1, output.shape[-1])
        bound = self.noise_alpha / math.sqrt(length * dim)
        self.forwards += 1
        self.bound = bound
        return output + torch.empty_like(output).uniform_(-bound, bound)

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
