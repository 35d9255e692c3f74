"""Weight averaging: ``EMA`` and ``SWA`` (Keras' ``SwapEMAWeights`` is in :mod:`fitkit.callbacks.swap_ema`).

``EMA`` and ``SWA`` are :class:`~fitkit.callbacks.weight_averaging.WeightAveraging` callbacks
(one base over :mod:`torch.optim.swa_utils`): the average lives in an ``AveragedModel`` and
weights move between it and ``model.module`` in place, so the optimizer, hooks and a compiled
forward keep pointing at the module's own parameters.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, get_ema_multi_avg_fn, update_bn

from fitkit.callbacks.weight_averaging import WeightAveraging
from fitkit.checks import FitkitWarning, check_bool, check_choice, check_int, check_number
from fitkit.checks.declared import Option, declare, declared, verbose_option
from fitkit.files.content import is_count, is_number, typed_problems
from fitkit.modes import modes

__all__ = ["EMA", "SWA", "WeightAveraging"]


_EMA_OPTIONS = declare(
    "EMA",
    Option(
        "decay",
        "number",
        minimum=0.0,
        maximum=1.0,
        allow_none=True,
        pointless=(
            1.0,
            "the average keeps the weights it starts from and never moves. Fix: pass decay < 1, e.g. decay=0.999.",
        ),
    ),
    # > 0 declared; finite checked in EMA.__init__ (inf: an average that never moves)
    Option("half_life", "number", positive=True, allow_none=True, bad=(float("inf"),)),
    Option("update_interval", "custom", checked_in="EMA.__init__", bad=("batch", 1)),
    Option("evaluate_with_ema", "bool"),
    Option("swap_at_end", "bool"),
    Option("use_buffers", "bool"),
    verbose_option(),
    Option("update_every_n_steps", "int", minimum=1),
    Option(
        "update_starting_at_step", "int", minimum=0, allow_none=True, excludes=("update_starting_at_epoch",), example=2
    ),
    Option("update_starting_at_epoch", "int", minimum=0, allow_none=True, example=1),
    Option("overwrite_every_n_steps", "int", minimum=1, allow_none=True),
)


class EMA(WeightAveraging):
    """Keep an exponential moving average of the weights (Keras' ``use_ema``, timm's ``ModelEma``).

    A :class:`~fitkit.callbacks.weight_averaging.WeightAveraging` with torch's
    :func:`~torch.optim.swa_utils.get_ema_multi_avg_fn` (``torch._foreach_lerp_``; no host
    sync per step). At ``on_train_begin`` the average is a copy of the module; after each
    optimizer step (a batch end at which ``model.global_step`` advanced, so with gradient
    accumulation once per group, and never for a step that mixed precision skipped) it
    becomes ``decay * ema + (1 - decay) * weights``. After ``k`` steps from weights ``w_0``
    (the start) to ``w_k`` it is ``decay**k * w_0 + sum_i (1 - decay) * decay**(k - i) * w_i``.
    With ``update_starting_at_step`` or ``update_starting_at_epoch`` (Lightning's
    ``EMAWeightAveraging``) there is no copy at the start: the first update copies the
    weights of that step, and ``update_every_n_steps`` thins the updates (steps ``k`` with
    ``k % n == 0``, 0-based). ``overwrite_every_n_steps`` (Keras' ``ema_overwrite_frequency``)
    copies the average into the module after every n-th optimizer step (1-based), and training
    continues from it.

    ``half_life`` (Composer's ``EMA(half_life=...)``) sets the decay instead: the weight of the
    old average halves every ``half_life`` updates' worth of time, so each update uses
    ``decay = exp(-log(2) * n / half_life)`` with ``n = update_every_n_steps`` (Composer's
    ``smoothing`` for ``update_interval`` ``n`` and a half-life in the same unit).
    ``update_interval="epoch"`` (Composer's ``update_interval="1ep"``) updates at each epoch
    end instead of after optimizer steps (from ``update_starting_at_epoch`` on, the first update
    copying then if it is given); ``half_life`` is then in epochs.

    With ``evaluate_with_ema`` the validation inside ``fit`` runs on the averaged weights: they
    are copied into ``model.module`` at ``on_test_begin`` and the training weights are copied
    back, bit for bit, at ``on_test_end``; :meth:`scored_weights` gives those weights to
    ``EarlyStopping(restore_best_weights=True)`` and ``ModelCheckpoint(save_best_only=True)``,
    so the weights they keep are the ones that scored the best ``val_`` value. With
    ``swap_at_end`` the averaged weights replace the module's when ``fit`` ends (unless
    ``EarlyStopping(restore_best_weights=True)`` restores the best weights: that wins). The
    average is part of the callback's state, so it is saved in checkpoints and a resumed run
    continues it exactly. Two EMAs (or an EMA and another averaging callback) may run in one
    ``fit``, but only one may validate on its average and only one may swap in at the end
    (``evaluate_with_ema=False`` / ``swap_at_end=False`` on the others); ``fit`` refuses more
    before step 1 (see :class:`~fitkit.callbacks.weight_averaging.WeightAveraging`).
    Floating-point tensors follow torch's formula; integer buffers (BatchNorm's
    ``num_batches_tracked``) with ``use_buffers`` follow its integer rounding.

    Args:
        decay: the weight of the old average in ``[0, 1]``; ``1 - decay`` is the weight of the
            new weights (``None``: 0.999, an average over roughly the last 1000 steps, unless
            ``half_life`` is given).
        evaluate_with_ema: validate on the averaged weights during ``fit``.
        swap_at_end: put the averaged weights into ``model.module`` when ``fit`` ends.
        use_buffers: average the buffers too (BatchNorm statistics), as timm does; ``False``
            averages the parameters only and evaluates with the module's own buffers.
        verbose: 1 prints a line when the weights are swapped in at the end.
        half_life: the half-life of the average, in optimizer steps (``update_interval="step"``)
            or epochs (``"epoch"``), a positive finite number; not with ``decay``.
        update_interval: ``"step"`` (after optimizer steps) or ``"epoch"`` (at epoch ends; no
            step option then).
        update_every_n_steps: update at every n-th optimizer step.
        update_starting_at_step: the 0-based first step that updates (the first copies).
        update_starting_at_epoch: the 0-based first epoch whose steps update.
        overwrite_every_n_steps: copy the average into the module every n optimizer steps.

    Attributes:
        averaged_model: the ``AveragedModel``; ``averaged_model.module`` is a module holding
            the averaged weights (``None`` before the first ``fit``).

    Raises:
        TypeError: ``decay`` or ``half_life`` is not a number, a flag not a bool, a step count
            not an int.
        ValueError: ``decay`` outside ``[0, 1]``, ``half_life`` not positive and finite, both
            given, an unknown ``update_interval`` or a step option with ``"epoch"``, a step
            count below its minimum; at
            ``on_train_begin``, a module sharded with ``strategy="fsdp"``; at ``fit``, before
            step 1, a second average to validate on or to swap in at the end.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> _ = torch.nn.init.ones_(model.module.weight)
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse")
        >>> ema = EMA(decay=0.5)
        >>> _ = model.fit(torch.ones(1, 1), torch.zeros(1, 1), epochs=2, callbacks=[ema], verbose=0)
        >>> model.module.weight.item(), ema.averaged_model.module.weight.item()  # 1 -> 0.5 -> 0.25
        (0.25, 0.5)
        >>> ema = EMA(half_life=1, update_interval="epoch")  # decay 0.5 per epoch end
        >>> _ = model.fit(torch.ones(1, 1), torch.zeros(1, 1), epochs=2, callbacks=[ema], verbose=0)
        >>> ema.decay, ema.averaged_model.module.weight.item()  # (0.25 + 0.125) / 2, then (. + 0.0625) / 2
        (0.5, 0.125)
    """

    _copy_at_start = True

    @declared(_EMA_OPTIONS)
    def __init__(
        self,
        decay: float | None = None,
        evaluate_with_ema: bool = True,
        swap_at_end: bool = False,
        use_buffers: bool = True,
        verbose: int = 0,
        *,
        half_life: float | None = None,
        update_interval: str = "step",
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        overwrite_every_n_steps: int | None = None,
    ):
        check_choice("update_interval", update_interval, ("step", "epoch"))
        _check_epoch_interval(update_interval, update_every_n_steps, update_starting_at_step, overwrite_every_n_steps)
        decay = _decay(decay, half_life, update_every_n_steps)
        check_bool("evaluate_with_ema", evaluate_with_ema)
        check_int("overwrite_every_n_steps", overwrite_every_n_steps, 1, allow_none=True)
        super().__init__(
            multi_avg_fn=get_ema_multi_avg_fn(decay),
            use_buffers=use_buffers,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
            evaluate_with_average=evaluate_with_ema,
            swap_at_end=swap_at_end,
            verbose=verbose,
        )
        self.decay, self.overwrite_every_n_steps = decay, overwrite_every_n_steps
        self.half_life, self.update_interval = half_life, update_interval

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether the weights join the average now: after optimizer steps (``update_interval="step"``,
        the base's rule) or at epoch ends (``"epoch"``, from ``update_starting_at_epoch`` on)."""
        if self.update_interval == "step":
            return super().should_update(step_idx, epoch_idx)
        start = self.update_starting_at_epoch
        return epoch_idx is not None and (start is None or epoch_idx >= start)

    @property
    def evaluate_with_ema(self) -> bool:
        """Whether the validation inside ``fit`` runs on the averaged weights."""
        return self.evaluate_with_average

    def _after_update(self, step: int) -> None:
        n = self.overwrite_every_n_steps
        if n is not None and step % n == 0:
            # Keras' ema_overwrite_frequency: train on from the average (the training weights,
            # wherever they are: set aside while another average is swapped in).
            for avg, cur in self._training_groups():
                torch._foreach_copy_(cur, avg)


def _decay(decay: Any, half_life: Any, every: int) -> float:
    """The decay per update: ``decay`` as given, or from ``half_life`` (Composer's formula), or 0.999."""
    if decay is not None and half_life is not None:
        raise ValueError(
            f"Pass `decay` or `half_life`, not both. Received: decay={decay!r}, half_life={half_life!r}. "
            "Fix: drop one; half_life=h gives decay = exp(-log(2) / h) per update."
        )
    if half_life is not None:
        check_number("half_life", half_life, positive=True)
        if math.isinf(half_life):
            raise ValueError(f"Expected `half_life` to be a finite positive number. Received: half_life={half_life!r}.")
        return math.exp(-math.log(2) * every / half_life)
    decay = 0.999 if decay is None else decay
    check_number("decay", decay, minimum=0.0)
    if decay > 1:
        raise ValueError(f"Expected `decay` in [0, 1]. Received: decay={decay!r}.")
    return float(decay)


def _check_epoch_interval(interval: str, every: Any, start_step: Any, overwrite: Any) -> None:
    """``update_interval="epoch"`` takes none of the step options."""
    if interval != "epoch":
        return
    for name, value, default in (
        ("update_every_n_steps", every, 1),
        ("update_starting_at_step", start_step, None),
        ("overwrite_every_n_steps", overwrite, None),
    ):
        if value != default:
            raise ValueError(
                f"`{name}` counts optimizer steps, but update_interval='epoch' updates at epoch ends. "
                f"Received: {name}={value!r}. Fix: drop it, or use update_starting_at_epoch / update_interval='step'."
            )


_SWA_OPTIONS = declare(
    "SWA",
    Option("swa_lrs", "custom", checked_in="SWA.__init__", bad=(0, -0.1, "0.01", [0.01, -1])),
    Option("swa_epoch_start", "custom", checked_in="SWA.__init__", bad=(0, 1.5, "1", True)),
    Option("annealing_epochs", "int", minimum=0),
    Option("annealing_strategy", "choice", choices=("cos", "linear")),
    Option("avg_fn", "callable", allow_none=True),
    Option("multi_avg_fn", "callable", allow_none=True),
)


class SWA(WeightAveraging):
    """Stochastic weight averaging (Izmailov et al. 2018; Lightning's ``StochasticWeightAveraging``).

    From epoch ``swa_epoch_start`` on, :class:`~torch.optim.swa_utils.SWALR` anneals every
    parameter group's learning rate to its ``swa_lrs`` over ``annealing_epochs`` epochs (it is
    stepped once per epoch by this callback), and at the end of that epoch and of every later
    one the weights join an equal-weight average (:class:`~torch.optim.swa_utils.AveragedModel`),
    as in torch's SWA recipe (the base's :meth:`should_update` asked with ``epoch_idx``; the
    validation runs on the training weights, as in Lightning). When ``fit`` ends, the average
    is copied into ``model.module`` and BatchNorm statistics are recomputed with
    :func:`~torch.optim.swa_utils.update_bn` over one pass of the training data
    (``params["train_data"]``), since the averaged weights never ran with the statistics
    training left behind; ``EarlyStopping(restore_best_weights=True)`` restoring the best
    weights then wins over both, in either list order. SWA always swaps in at the end, so
    ``fit`` refuses it with another callback that does (``compile(use_ema=True)``, an
    ``EMA(swap_at_end=True)``, another ``SWA``) before step 1.

    A scheduler given to ``compile`` is set aside while SWA runs (Lightning replaces it the
    same way): ``model.scheduler`` is ``None`` from the start epoch on, so it no longer steps,
    and it is put back, in the state it had when SWA began, when ``fit`` ends.

    Args:
        swa_lrs: the learning rate to anneal to, one for every parameter group or a list with
            one per group.
        swa_epoch_start: the 1-based epoch whose end is the first one averaged (an int >= 1),
            or a fraction in ``(0, 1]`` of ``epochs``: ``int(fraction * epochs)`` (Lightning).
        annealing_epochs: epochs to reach ``swa_lrs`` (0: at once).
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: ``(averaged, current, num_averaged) -> new averaged``, per tensor, instead of the
            equal-weight mean (as :class:`~torch.optim.swa_utils.AveragedModel` and every
            :class:`~fitkit.callbacks.WeightAveraging` take it); ``num_averaged`` is a 0-dim
            tensor, the count of averages before this one.
        multi_avg_fn: ``(averaged_list, current_list, num_averaged) -> None``, in place, on the
            tensors of one device and dtype at a time. Not with ``avg_fn``.

    Attributes:
        averaged_model: the ``AveragedModel`` (``None`` before the first ``fit``);
            ``averaged_model.n_averaged`` counts the averaged epochs.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: bad values; at ``on_train_begin``, a ``swa_lrs`` list whose length is not
            the number of parameter groups, or a module sharded with ``strategy="fsdp"``.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> _ = torch.nn.init.ones_(model.module.weight)
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse")
        >>> swa = SWA(swa_lrs=0.25, swa_epoch_start=2)
        >>> _ = model.fit(torch.ones(1, 1), torch.zeros(1, 1), epochs=3, callbacks=[swa], verbose=0)
        >>> model.module.weight.item()  # the mean of 0.25 and 0.125, the weights after epochs 2 and 3
        0.1875
    """

    @declared(_SWA_OPTIONS)
    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: Callable[..., torch.Tensor] | None = None,
        multi_avg_fn: Callable[..., None] | None = None,
    ):
        super().__init__(
            avg_fn=avg_fn, multi_avg_fn=multi_avg_fn, use_buffers=False, evaluate_with_average=False, swap_at_end=True
        )
        lrs = swa_lrs if isinstance(swa_lrs, (list, tuple)) else [swa_lrs]
        for lr in lrs:
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
                raise ValueError(
                    f"Expected `swa_lrs` to be a positive number or a list of them. Received: swa_lrs={swa_lrs!r}."
                )
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)):
            raise TypeError(f"Expected `swa_epoch_start` to be an int or a float. Received: {swa_epoch_start!r}.")
        if (
            isinstance(swa_epoch_start, int)
            and swa_epoch_start < 1
            or (isinstance(swa_epoch_start, float) and not 0 < swa_epoch_start <= 1)
        ):
            raise ValueError(
                "Expected `swa_epoch_start` to be an int >= 1 (an epoch, 1-based) or a float in (0, 1] "
                f"(a fraction of the epochs). Received: swa_epoch_start={swa_epoch_start!r}."
            )
        check_int("annealing_epochs", annealing_epochs, 0)
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(
                "Expected `annealing_strategy` to be 'cos' or 'linear'. "
                f"Received: annealing_strategy={annealing_strategy!r}."
            )
        self.swa_lrs = list(swa_lrs) if isinstance(swa_lrs, (list, tuple)) else float(swa_lrs)
        self.swa_epoch_start, self.annealing_epochs = swa_epoch_start, annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.swa_scheduler: SWALR | None = None
        self._start = 0  # 0-based first averaged epoch
        self._set_aside: Any = None  # the compiled scheduler, while SWA runs
        self._set_aside_state: dict[str, Any] | None = None
        self._swa_pending: dict[str, Any] | None = None

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """The ends of the epochs from ``swa_epoch_start`` on (SWALR runs then)."""
        return epoch_idx is not None and self.swa_scheduler is not None

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state["swa_scheduler"] = None if self.swa_scheduler is None else self.swa_scheduler.state_dict()
            state["set_aside"] = self._set_aside_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._swa_pending = state or None  # SWALR exists from the start epoch on

    def _state_problems(self, state: Any) -> list[str]:
        """The average's state (:class:`WeightAveraging`), and SWALR's and the set-aside scheduler's."""
        out = super()._state_problems(state)
        if out or not state:
            return out
        dict_or_none = (lambda v: v is None or isinstance(v, dict), "a scheduler's state dict or None")
        spec = {"swa_scheduler": dict_or_none, "set_aside": dict_or_none}
        out = typed_problems(state, spec, "its state")
        groups = len(self.model.optimizer.param_groups) if getattr(self, "model", None) is not None else None
        for key, own in (("swa_scheduler", _SWALR_STATE), ("set_aside", {})):
            if not out and state[key] is not None:
                fields = {**_scheduler_state(groups), **own}
                out = typed_problems(state[key], fields, f"its state[{key!r}]", frozenset(fields))
        return out

    # -- hooks -----------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        groups = len(self.model.optimizer.param_groups)
        if isinstance(self.swa_lrs, list) and len(self.swa_lrs) != groups:
            raise ValueError(
                f"`swa_lrs` has {len(self.swa_lrs)} values, but the optimizer has {groups} parameter "
                "groups. Fix: pass one value per group, or a single number."
            )
        start = self.swa_epoch_start
        epochs = self.params.get("epochs") or 1
        self._start = max(int(start * epochs) - 1, 0) if isinstance(start, float) else start - 1
        self.swa_scheduler, self._set_aside, self._set_aside_state = None, None, None
        super().on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if epoch < self._start or self.swa_scheduler is not None:
            return
        pending, self._swa_pending = self._swa_pending, None
        model = self.model
        self._set_aside = model.scheduler
        if self._set_aside is not None:
            if pending is not None and pending.get("set_aside") is not None:
                self._set_aside.load_state_dict(pending["set_aside"])
            self._set_aside_state = self._set_aside.state_dict()
            model.scheduler = None  # the loop steps model.scheduler: now it steps nothing
        self.swa_scheduler = SWALR(
            model.optimizer,
            swa_lr=self.swa_lrs,
            anneal_epochs=self.annealing_epochs,
            anneal_strategy=self.annealing_strategy,
        )
        if pending is not None and pending.get("swa_scheduler") is not None:
            self.swa_scheduler.load_state_dict(pending["swa_scheduler"])

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.swa_scheduler is not None:
            self.swa_scheduler.step()  # the learning rate of the next epoch

    def on_train_end(self, logs=None):
        if self._set_aside is not None:
            self.model.scheduler, self._set_aside = self._set_aside, None
        super().on_train_end(logs)  # the average into the module, if any epoch was averaged
        if self._swapped_at_end:  # not when another callback restores the best weights instead
            self._update_bn(self.model.module)

    def _update_bn(self, module: nn.Module) -> None:
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
            return
        data = self.params.get("train_data")
        it = iter(data) if data is not None else iter(())
        first = next(it, None)
        if first is None:
            warnings.warn(
                "SWA could not recompute the BatchNorm statistics: the training data yields no "
                "batch after fit (a one-shot generator?). Fix: pass data that can be iterated again.",
                category=FitkitWarning,
                stacklevel=2,
            )
            return
        with modes(module, training=None, grad=False):  # update_bn sets train mode; flags come back
            # update_bn feeds the first element of each batch to the module it is given.
            update_bn(([b[0]] for b in itertools.chain([first], it)), _FeedX(module))


def _rates(groups: int | None) -> tuple[Any, str]:
    def check(v: Any) -> bool:
        ok = isinstance(v, list) and all(is_number(x) and 0 <= x < float("inf") for x in v)
        return ok and (groups is None or len(v) == groups)

    return check, f"a list of {groups or 'the'} finite number(s) >= 0, one per parameter group"


def _scheduler_state(groups: int | None) -> dict[str, tuple[Any, str]]:
    """The fields every torch scheduler keeps (a saved SWALR's, or the scheduler SWA set aside)."""
    return {
        "last_epoch": (lambda v: v == -1 or is_count(v), "an int >= -1"),
        "_step_count": (is_count, "an int >= 0"),
        "base_lrs": _rates(groups),
        "_last_lr": _rates(groups),
        **{flag: (lambda v: v is False, "False (torch sets it only inside step())") for flag in _FLAGS},
    }


_FLAGS = ("_is_initial", "_get_lr_called_within_step")


#: SWALR's own fields (its constructor's checks).
_SWALR_STATE = {
    "anneal_epochs": (is_count, "an int >= 0"),
    "_anneal_strategy": (lambda v: v in ("cos", "linear"), "'cos' or 'linear'"),
}


class _FeedX(nn.Module):
    """Calls the module as fit does: a tuple ``x`` is ``module(*x)``, a dict ``module(**x)``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Any:
        if isinstance(x, tuple):
            return self.module(*x)
        if isinstance(x, dict):
            return self.module(**x)
        return self.module(x)
