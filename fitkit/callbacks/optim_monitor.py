"""What the optimizer does: ``OptimizerMonitor`` (gradient and update norms) and
``LearningRateMonitor`` (momentum, betas and weight decay beside the learning rate).

``OptimizerMonitor`` answers Composer's ``OptimizerMonitor`` and Lightning's gradient-norm
logging (``grad_norm(module, norm_type)`` in ``on_before_optimizer_step``);
``LearningRateMonitor`` answers Lightning's ``LearningRateMonitor(log_momentum=True,
log_weight_decay=True)``: fitkit logs ``learning_rate`` in every epoch's logs already.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.checks import FitkitWarning, check_bool, check_int, check_number
from fitkit.checks.declared import Option, declare, declared

__all__ = ["OptimizerMonitor", "LearningRateMonitor"]


_OPTIMIZER_MONITOR_OPTIONS = declare(
    "OptimizerMonitor",
    Option("log_every_n_steps", "int", minimum=1),
    Option("norm_type", "number", positive=True),
    Option("per_parameter", "bool"),
    Option("log_update_norm", "bool"),
)


class OptimizerMonitor(Callback):
    """Gradient and update norms, total and per parameter, every ``log_every_n_steps`` steps.

    At each optimizer step ``k`` (``model.global_step`` after it, 1-based) with
    ``k % log_every_n_steps == 0``, in ``on_backward_end`` (after the last backward of the
    step, gradients unscaled, before clipping and the optimizer step, as Lightning's
    ``on_before_optimizer_step``) the norm of each parameter's gradient is taken, and with
    ``log_update_norm`` the parameters are copied; after the step the norm of each change
    ``p_after - p_before`` is taken. Keys: ``grad_norm`` (the ``norm_type`` norm of all
    gradients together, as ``torch.nn.utils.clip_grad_norm_`` computes it), ``grad_norm/<name>``
    per parameter (``per_parameter``), and ``update_norm``, ``update_norm/<name>`` likewise. A
    step that mixed precision skipped is not recorded.

    The norms stay on the device: no step reads a device value on the host, logged or not.
    At each epoch end the epoch's records are read at once (one host read per epoch) into
    :attr:`history` (``{key: [float per logged step]}``) and :attr:`steps` (their
    ``global_step``). Copying the parameters for the update norm costs one copy of the
    trainable weights on the logged steps only.

    Args:
        log_every_n_steps: record every n-th optimizer step (an int >= 1; Lightning's
            ``log_every_n_steps``, Composer's ``batch_log_interval``).
        norm_type: the order of the norm (``2.0``; ``math.inf``: the largest absolute value).
        per_parameter: also record each parameter's norms under its name (``named_parameters``).
        log_update_norm: also record the norm of each step's change of the weights.

    Attributes:
        history: ``{key: [float per logged step]}``, filled at each epoch end.
        steps: the ``global_step`` of each logged step.

    Raises:
        TypeError: a count that is not an int, ``norm_type`` not a number, a flag not a bool.
        ValueError: ``log_every_n_steps < 1`` or ``norm_type`` not positive.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> _ = torch.nn.init.ones_(model.module.weight)
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse")
        >>> monitor = OptimizerMonitor(log_every_n_steps=2)
        >>> x, y = torch.ones(4, 1), torch.zeros(4, 1)
        >>> _ = model.fit(x, y, batch_size=1, shuffle=False, callbacks=[monitor], verbose=0)
        >>> monitor.steps, monitor.history["grad_norm"], monitor.history["update_norm/weight"]
        ([2, 4], [1.0, 0.25], [0.25, 0.0625])
    """

    @declared(_OPTIMIZER_MONITOR_OPTIONS)
    def __init__(
        self,
        log_every_n_steps: int = 50,
        norm_type: float = 2.0,
        *,
        per_parameter: bool = True,
        log_update_norm: bool = True,
    ):
        super().__init__()
        check_int("log_every_n_steps", log_every_n_steps, 1)
        check_number("norm_type", norm_type, positive=True)
        check_bool("per_parameter", per_parameter)
        check_bool("log_update_norm", log_update_norm)
        self.log_every_n_steps, self.norm_type = log_every_n_steps, float(norm_type)
        self.per_parameter, self.log_update_norm = per_parameter, log_update_norm
        self.history: dict[str, list[float]] = {}
        self.steps: list[int] = []
        self._records: list[tuple[int, dict[str, torch.Tensor]]] = []  # on the device until the epoch ends
        self._pending: tuple[int, dict[str, torch.Tensor], list[torch.Tensor]] | None = None

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.module.named_parameters() if p.requires_grad]

    def _norms(self, prefix: str, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not named:
            return {}
        per = torch._foreach_norm([t.detach() for _, t in named], self.norm_type)
        total = torch.linalg.vector_norm(torch.stack([n.to(per[0].device).float() for n in per]), self.norm_type)
        out = {prefix: total}
        if self.per_parameter:
            out.update({f"{prefix}/{name}": n for (name, _), n in zip(named, per, strict=True)})
        return out

    def on_train_begin(self, logs=None):
        self._pending = None

    def on_backward_end(self, batch):
        step = self.model.global_step + 1  # the step about to be taken
        if step % self.log_every_n_steps:
            return
        named = self._named()
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        before = [p.detach().clone() for _, p in named] if self.log_update_norm else []
        self._pending = (step, self._norms("grad_norm", grads), before)

    def on_train_batch_end(self, batch, logs=None):
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, record, before = pending
        if self.model.global_step != step:  # mixed precision skipped the step: nothing changed
            return
        if self.log_update_norm:
            named = self._named()
            record.update(
                self._norms("update_norm", [(n, p.detach() - b) for (n, p), b in zip(named, before, strict=True)])
            )
        self._records.append((step, record))

    def on_epoch_end(self, epoch, logs=None):
        records, self._records = self._records, []
        if not records:
            return
        keys = [list(r) for _, r in records]
        values = torch.stack([v.float().cpu() for _, r in records for v in r.values()]).tolist()  # one read
        it = iter(values)
        for (step, _), names in zip(records, keys, strict=True):
            self.steps.append(step)
            for key in names:
                self.history.setdefault(key, []).append(next(it))


#: What each hyper-parameter is read from in a parameter group: Adam's betas give momentum (beta1).
_READERS = {
    "momentum": lambda g: g["momentum"] if "momentum" in g else (g["betas"][0] if "betas" in g else None),
    "beta2": lambda g: g["betas"][1] if "betas" in g else None,
    "weight_decay": lambda g: g.get("weight_decay"),
}


def _number(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)  # a tensor beta: once per epoch


_LEARNING_RATE_MONITOR_OPTIONS = declare(
    "LearningRateMonitor",
    Option("log_momentum", "bool"),
    Option("log_weight_decay", "bool"),
)


class LearningRateMonitor(Callback):
    """Log momentum (or Adam's betas) and weight decay beside ``learning_rate`` in the epoch logs.

    fitkit logs ``learning_rate`` (and ``learning_rate/<name>`` per group) every epoch; this
    callback adds, read from the optimizer's parameter groups at the epoch's last optimizer
    step (before a per-step scheduler moved them, as ``learning_rate``): ``momentum`` (SGD's
    and RMSprop's ``momentum``, or ``betas[0]`` for the Adam family, as Lightning logs it) and
    ``beta2`` (``betas[1]``) with ``log_momentum``, and ``weight_decay`` with
    ``log_weight_decay``. Group 0 gives the plain key; a group with a ``"name"`` also gets
    ``<key>/<name>``, and when the groups' values differ at the start of ``fit`` every group
    ``i >= 1`` gets ``<key>/pg<i>`` (fitkit's per-group convention for ``learning_rate``). The
    keys go into History, CSVLogger and TensorBoard with the others. An optimizer without the
    hyper-parameter (Adagrad has no momentum) gives a warning at the start of ``fit`` and no key.

    Args:
        log_momentum: log ``momentum`` and, for betas, ``beta2``.
        log_weight_decay: log ``weight_decay``.

    Raises:
        TypeError: a flag that is not a bool.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.AdamW(p, betas=(0.8, 0.95)), loss="mse")
        >>> history = model.fit(torch.ones(2, 1), torch.zeros(2, 1), callbacks=[LearningRateMonitor(
        ...     log_weight_decay=True)], verbose=0)
        >>> {k: history.history[k] for k in ("learning_rate", "momentum", "beta2", "weight_decay")}
        {'learning_rate': [0.001], 'momentum': [0.8], 'beta2': [0.95], 'weight_decay': [0.01]}
    """

    @declared(_LEARNING_RATE_MONITOR_OPTIONS)
    def __init__(self, log_momentum: bool = True, log_weight_decay: bool = False):
        super().__init__()
        check_bool("log_momentum", log_momentum)
        check_bool("log_weight_decay", log_weight_decay)
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self._keys: list[tuple[str, int, str]] = []  # (quantity, group index, log key)
        self._used: list[dict[str, Any]] | None = None  # the hyper-parameters of the last step

    def _quantities(self) -> list[str]:
        momentum = ["momentum", "beta2"] if self.log_momentum else []
        return momentum + (["weight_decay"] if self.log_weight_decay else [])

    def on_train_begin(self, logs=None):
        groups = self.model.optimizer.param_groups
        self._keys, self._used = [], None
        for quantity in self._quantities():
            values = [_READERS[quantity](g) for g in groups]
            if values[0] is None:
                if quantity != "beta2":
                    warnings.warn(
                        f"LearningRateMonitor: {type(self.model.optimizer).__name__} has no {quantity}; "
                        "it is not logged.",
                        FitkitWarning,
                        stacklevel=2,
                    )
                continue
            differ = len({repr(v) for v in values}) > 1
            self._keys.append((quantity, 0, quantity))
            for i, g in enumerate(groups):
                if g.get("name") is not None:
                    self._keys.append((quantity, i, f"{quantity}/{g['name']}"))
                elif differ and i:
                    self._keys.append((quantity, i, f"{quantity}/pg{i}"))

    def _now(self) -> list[dict[str, Any]]:
        return [{q: _READERS[q](g) for q in self._quantities()} for g in self.model.optimizer.param_groups]

    def on_backward_end(self, batch):
        # The values the coming step uses (host numbers, no device read); a scheduler may move them after.
        self._used = self._now()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._keys:
            return
        used = self._used or self._now()
        logs.update({key: _number(used[i][quantity]) for quantity, i, key in self._keys})
