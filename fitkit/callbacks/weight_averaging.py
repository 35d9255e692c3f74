"""``WeightAveraging``: the one base of ``EMA`` and ``SWA`` (over ``torch.optim.swa_utils``).

The average lives in an :class:`~torch.optim.swa_utils.AveragedModel` next to ``model.module``;
weights move between the two in place (``Tensor.copy_``), so the optimizer, hooks and a
compiled forward keep pointing at the module's own parameters. Each update runs
``AveragedModel``'s functions (``avg_fn`` / ``multi_avg_fn``) but counts the updates on the
host as well as in the ``n_averaged`` buffer, so that no update reads a device value on the
host (torch's ``update_parameters`` reads ``n_averaged`` twice per call: a CUDA sync each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_swa_multi_avg_fn

from fitkit.callbacks.average_fns import try_average_fn
from fitkit.callbacks.base import Callback
from fitkit.callbacks.swapping import WeightSwap, copy_tensors, no_swap, restorer, weight_swap
from fitkit.checks import check_bool, check_int
from fitkit.checks.declared import Option, declare, declared, verbose_option
from fitkit.distributed import say

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["WeightAveraging"]

Tensors = list[torch.Tensor]


def _refuse_fsdp(model: Model, who: str) -> None:
    if getattr(model, "strategy", None) == "fsdp" and torch.distributed.is_initialized():
        raise ValueError(
            f"{who} keeps a full copy of the module, which a sharded (strategy='fsdp') module "
            "does not have. Fix: use strategy='ddp'."
        )


def _check_fn(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"Expected `{name}` to be a function or None. Received: {name}={fn!r}.")


_WEIGHT_AVERAGING_OPTIONS = declare(
    "WeightAveraging",
    Option("avg_fn", "callable", allow_none=True, example=lambda a, c, n: a),
    Option("multi_avg_fn", "callable", allow_none=True, example=lambda a, c, n: None),
    Option("use_buffers", "bool"),
    Option("update_every_n_steps", "int", minimum=1),
    Option(
        "update_starting_at_step", "int", minimum=0, allow_none=True, excludes=("update_starting_at_epoch",), example=2
    ),
    Option("update_starting_at_epoch", "int", minimum=0, allow_none=True, example=1),
    Option("evaluate_with_average", "bool"),
    Option("swap_at_end", "bool"),
    verbose_option(),
)


@dataclass(frozen=True)
class _Layout:
    """The average's tensors beside the module's, grouped by device and dtype (one fused update each).

    Attributes:
        pairs: ``(averaged, module)`` tensors per group.
        index: per group, the tensors' places in the module's parameters (+ buffers).
        n_params: the module's parameter count (its buffers follow in those places).
    """

    pairs: list[tuple[Tensors, Tensors]] = field(default_factory=list)
    index: list[list[int]] = field(default_factory=list)
    n_params: int = 0


class WeightAveraging(Callback):
    """Average the weights during ``fit`` (Lightning's ``WeightAveraging``); base of EMA and SWA.

    After each optimizer step (``model.global_step`` advanced: once per accumulation group,
    never for a step mixed precision skipped) the callback asks :meth:`should_update` with
    ``step_idx``, the 0-based index of that step (``global_step - 1``); at each epoch end it
    asks with ``epoch_idx``. When it says yes, the weights join the average: the first update
    copies them, each later one calls ``avg_fn(averaged, current, num_averaged)`` on every
    tensor, or ``multi_avg_fn(averaged_list, current_list, num_averaged)`` on the tensors of
    each device and dtype (``num_averaged``: the ``n_averaged`` buffer, a device tensor, as
    in :class:`~torch.optim.swa_utils.AveragedModel`); neither given: the equal-weight mean
    (SWA). The default rule updates at the steps ``k`` with ``k % update_every_n_steps == 0``,
    from step ``update_starting_at_step`` and epoch ``update_starting_at_epoch`` (0-based) on;
    override :meth:`should_update` for another one.

    With ``evaluate_with_average`` the validation inside ``fit`` runs on the averaged weights
    (once one update ran): they go into ``model.module`` at ``on_test_begin`` and the training
    weights come back, bit for bit, at ``on_test_end``. Those are then the weights that
    ``val_`` keys score, and :meth:`scored_weights` puts them back in place for the callbacks
    that keep or write the best weights (``EarlyStopping(restore_best_weights=True)``,
    ``ModelCheckpoint(save_best_only=True)``; see :mod:`fitkit.callbacks.scoring`). With
    ``swap_at_end`` the averaged weights replace the module's when ``fit`` ends, unless
    ``EarlyStopping(restore_best_weights=True)`` restores the best weights then: the restore
    wins, in either list order. The average, its count and the step of the last update are the
    callback's state: a checkpoint resumes it bit for bit (one written while the average is in
    the module carries the training weights too).

    One swap at a time (:mod:`fitkit.callbacks.swapping`): all averaging callbacks of a module
    swap through its one :attr:`weight_swap`, so the training weights are set aside once and come
    back once, and training continues from them. Several may run in one ``fit``, but at most one
    validates on its average (``evaluate_with_average``, ``evaluate_with_ema``, a
    ``SwapEMAWeights``' EMA) and at most one swaps in at the end; ``fit`` refuses two before step 1.

    Args:
        avg_fn: ``(averaged, current, num_averaged) -> new averaged``, per tensor.
        multi_avg_fn: ``(averaged_list, current_list, num_averaged) -> None``, in place. Either
            is called once at ``on_train_begin`` on copies of one weight (``num_averaged`` 1), so
            a broken function is refused before step 1 (a ``ValueError``), nothing changed.
        use_buffers: average the buffers too (BatchNorm statistics); ``False`` averages the
            parameters and keeps the module's own buffers.
        update_every_n_steps: update at every n-th optimizer step (an int >= 1).
        update_starting_at_step: the 0-based first step that may update (``None``: from the
            start).
        update_starting_at_epoch: the 0-based first epoch whose steps may update.
        evaluate_with_average: validate on the averaged weights during ``fit``.
        swap_at_end: put the averaged weights into ``model.module`` when ``fit`` ends.
        verbose: 1 prints a line when the weights are swapped in at the end.

    Attributes:
        averaged_model: the ``AveragedModel`` (``None`` before the first ``fit``);
            ``averaged_model.module`` holds the averaged weights.
        num_averaged: updates so far (a host int, equal to ``averaged_model.n_averaged``).

    Raises:
        TypeError: a function that is not callable, a flag that is not a bool, a step that is
            not an int.
        ValueError: both ``avg_fn`` and ``multi_avg_fn``; a count below its minimum; at
            ``on_train_begin``, a module sharded with ``strategy="fsdp"``; at ``fit``, before
            step 1, another averaging callback that also validates on its average, or that also
            swaps its average in at the end.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> _ = torch.nn.init.ones_(model.module.weight)
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse")
        >>> avg = WeightAveraging(update_every_n_steps=2)  # the mean of steps 0 and 2 (1-based 1 and 3)
        >>> _ = model.fit(torch.ones(1, 1), torch.zeros(1, 1), epochs=4, callbacks=[avg], verbose=0)
        >>> avg.num_averaged, model.module.weight.item()  # (0.5 + 0.125) / 2, swapped in at the end
        (2, 0.3125)
    """

    #: EMA starts from a copy of the weights at ``on_train_begin`` when no start is given.
    _copy_at_start = False
    #: The average carries over into the next ``fit`` (``compile(use_ema=True)``'s, as Keras' optimizer).
    _continues = False

    @declared(_WEIGHT_AVERAGING_OPTIONS)
    def __init__(
        self,
        avg_fn: Callable[..., torch.Tensor] | None = None,
        multi_avg_fn: Callable[..., None] | None = None,
        *,
        use_buffers: bool = True,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        evaluate_with_average: bool = True,
        swap_at_end: bool = True,
        verbose: int = 0,
    ):
        super().__init__()
        _check_fn("avg_fn", avg_fn)
        _check_fn("multi_avg_fn", multi_avg_fn)
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("Pass `avg_fn` (per tensor) or `multi_avg_fn` (per list), not both.")
        for name, flag in (
            ("use_buffers", use_buffers),
            ("evaluate_with_average", evaluate_with_average),
            ("swap_at_end", swap_at_end),
        ):
            check_bool(name, flag)
        check_int("update_every_n_steps", update_every_n_steps, 1)
        check_int("update_starting_at_step", update_starting_at_step, 0, allow_none=True)
        check_int("update_starting_at_epoch", update_starting_at_epoch, 0, allow_none=True)
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step, self.update_starting_at_epoch = update_starting_at_step, update_starting_at_epoch
        self.evaluate_with_average, self.swap_at_end, self.verbose = evaluate_with_average, swap_at_end, verbose
        self.averaged_model: AveragedModel | None = None
        self.num_averaged = 0
        self._last_step = 0
        self._pending: dict[str, Any] | None = None  # a state loaded before the average exists
        self._restored = False
        self._in_fit = False
        self._swap: WeightSwap | None = None  # the module's one swap (fitkit.callbacks.swapping)
        self._layout = _Layout()  # the average's tensors beside the module's, built with the average
        self._give_back_test: Callable[[], None] = no_swap
        self._swapped_at_end = False

    # -- the rule ----------------------------------------------------------------------------
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether the weights join the average now (Lightning's ``should_update``).

        Args:
            step_idx: after an optimizer step, its 0-based index (``global_step - 1``).
            epoch_idx: at an epoch end, its 0-based index (``step_idx`` is then ``None``).

        Returns:
            The default: after steps only, at ``step_idx % update_every_n_steps == 0``, from
            ``update_starting_at_step`` and ``update_starting_at_epoch`` on.
        """
        if step_idx is None:
            return False
        if self.update_starting_at_step is not None and step_idx < self.update_starting_at_step:
            return False
        if self.update_starting_at_epoch is not None and self.model.epoch < self.update_starting_at_epoch:
            return False
        return step_idx % self.update_every_n_steps == 0

    # -- the average -------------------------------------------------------------------------
    def _tensors(self, module: nn.Module, averaged: bool) -> Tensors:
        mod = self.averaged_model.module if averaged else module  # type: ignore[union-attr]
        out = [p.detach() for p in mod.parameters()]
        return out + [b.detach() for b in mod.buffers()] if self.use_buffers else out

    def _build(self, module: nn.Module) -> None:
        self.averaged_model = AveragedModel(
            module, avg_fn=self.avg_fn, multi_avg_fn=self.multi_avg_fn, use_buffers=self.use_buffers
        )
        self.num_averaged = 0
        self._group(module)

    def _group(self, module: nn.Module) -> None:
        self._swap = weight_swap(module)
        groups: dict[tuple[torch.device, torch.dtype], tuple[Tensors, Tensors, list[int]]] = {}
        # The module's tensors are params (+ buffers): their places in state_tensors(module) are i.
        for i, (a, m) in enumerate(zip(self._tensors(module, True), self._tensors(module, False), strict=True)):
            mine = groups.setdefault((a.device, a.dtype), ([], [], []))
            mine[0].append(a)
            mine[1].append(m)
            mine[2].append(i)
        self._layout = _Layout(
            [(a, m) for a, m, _ in groups.values()],
            [i for _, _, i in groups.values()],
            len(list(module.parameters())),
        )

    def _training(self) -> Tensors | None:
        """The training weights while an averaged copy is swapped in (``None``: they are in the module)."""
        return None if self._swap is None else self._swap.saved

    def _training_groups(self) -> list[tuple[Tensors, Tensors]]:
        """``(averaged, training)`` per group: the module's tensors, or their copies set aside."""
        saved = self._training()
        if saved is None:
            return self._layout.pairs
        return [
            (avg, [saved[i] for i in idx]) for (avg, _), idx in zip(self._layout.pairs, self._layout.index, strict=True)
        ]

    def _copy_average_in(self) -> None:
        for avg, cur in self._layout.pairs:
            copy_tensors(cur, avg)

    @torch.no_grad()
    def update(self) -> None:
        """Add the module's current weights to the average (no host read of a device value)."""
        averaged = self.averaged_model
        if averaged is None:
            raise RuntimeError(f"{type(self).__name__}.update: no average yet; it is built at on_train_begin.")
        n = averaged.n_averaged  # a device tensor; the host count is self.num_averaged
        # The training weights, also while an average is swapped in (SwapEMAWeights' epoch ends).
        for avg, cur in self._training_groups():
            if self.num_averaged == 0:
                copy_tensors(avg, cur)
            elif self.avg_fn is not None:
                for a, c in zip(avg, cur, strict=True):
                    a.copy_(self.avg_fn(a, c, n.to(a.device)))
            elif self.multi_avg_fn is not None:
                self.multi_avg_fn(avg, cur, n.to(avg[0].device))
            else:  # the equal-weight mean, with the count from the host
                get_swa_multi_avg_fn()(avg, cur, self.num_averaged)
        if not self.use_buffers:  # the module's own buffers, as AveragedModel keeps them
            training = self._training()
            own = (
                [b.detach() for b in self.model.module.buffers()]
                if training is None
                else training[self._layout.n_params :]
            )
            copy_tensors([b.detach() for b in averaged.module.buffers()], own)
        averaged.n_averaged += 1
        self.num_averaged += 1
        if self._swap is not None and self._swap.holder is self:
            self._copy_average_in()  # the module shows the average it holds as it is now

    # -- moving weights ----------------------------------------------------------------------
    @property
    def weight_swap(self) -> WeightSwap | None:
        """The module's one :class:`~fitkit.callbacks.swapping.WeightSwap`, shared by every averaging
        callback (``None`` before the first ``fit``)."""
        return self._swap

    def swap_in(self) -> bool:
        """Put the averaged weights into ``model.module``, keeping the training ones aside.

        Another average that is in (another callback's) is taken out first, through the
        module's one :attr:`weight_swap`: the training weights are set aside once.

        Returns:
            Whether the module now holds the average (nothing to swap before the first update).
        """
        swap = self._swap
        if swap is not None and swap.holder is self:
            return True
        if swap is None or self.averaged_model is None or self.num_averaged == 0:
            return False
        swap.put(self, self._copy_average_in)
        return True

    def swap_out(self) -> None:
        """Put the training weights back, bit for bit (nothing if this average is not in)."""
        if self._swap is not None and self._swap.holder is self:
            self._swap.take_out()

    def lend_average(self) -> Callable[[], None]:
        """Put the averaged weights in for a while; the function returned puts back what was in.

        Returns:
            See :meth:`fitkit.callbacks.swapping.WeightSwap.lend`; ``no_swap`` (nothing to undo)
            when nothing was averaged yet or the average is in already.
        """
        swap = self._swap
        if swap is None or self.averaged_model is None or self.num_averaged == 0:
            return no_swap
        return swap.lend(self, self._copy_average_in)

    def weight_swaps(self, callbacks: list[Any]) -> tuple[Any, Any]:
        """``(validated, at_end)``: this callback where it validates on / ends ``fit`` with its
        average, else ``None`` (:func:`fitkit.callbacks.swapping.check_weight_swaps`)."""
        return (self if self.evaluate_with_average else None), (self if self.swap_at_end else None)

    @contextmanager
    def scored_weights(self, monitor: str) -> Iterator[None]:
        """Inside the block, ``model.module`` holds the weights that scored ``monitor``.

        The hook of :func:`fitkit.callbacks.scoring.scored_weights`: a ``val_`` key of a
        validation run on the averaged weights was scored on the average, so the block sees
        it; training keys were scored on the training weights, which stay. The training
        weights are back, bit for bit, after the block.

        Args:
            monitor: the log key whose weights are asked for.
        """
        # A val_ key was scored on the average only if a validation of this fit ran on it.
        scored = (
            self._in_fit
            and self.evaluate_with_average
            and monitor.startswith("val_")
            and bool(self.params.get("do_validation"))
        )
        give_back = self.lend_average() if scored else no_swap
        try:
            yield
        finally:
            give_back()

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.averaged_model is None:
            return {}
        state = {
            "averaged": self.averaged_model.state_dict(),
            "last_step": self._last_step,
            "num_averaged": self.num_averaged,
        }
        saved = self._training()
        if saved is not None and self._swap is not None and self._swap.holder is self:
            # A save while this average is in the module: its tensors' training weights, per group.
            state["training_weights"] = [saved[i] for idx in self._layout.index for i in idx]
        return state

    def loaded_by_fit(self) -> None:
        """The fit loaded this state itself (after ``on_train_begin``): nothing left to keep."""
        self._restored = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.averaged_model is None:
            self._pending = state
        else:
            self._load(state)
        self._restored = True  # the next on_train_begin keeps it

    def _state_problems(self, state: Any) -> list[str]:
        """A saved average against this callback's module (checked before any part loads)."""
        from fitkit.files import state_dict_differences
        from fitkit.files.content import is_count, typed_problems

        if isinstance(state, dict) and not state:
            return []  # saved before the average existed
        tensors = (
            lambda v: v is None or isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v),
            "None or a list of tensors",
        )
        spec = {
            "averaged": (lambda v: isinstance(v, dict), "the averaged model's state dict"),
            "last_step": (is_count, "an int >= 0"),
            "num_averaged": (lambda v: v is None or is_count(v), "an int >= 0 or None"),
            "training_weights": tensors,
        }
        out = typed_problems(state, spec, "its state", optional=frozenset({"num_averaged", "training_weights"}))
        model = getattr(self, "model", None)
        if out or model is None:
            return out
        expected = {
            "n_averaged": torch.zeros((), dtype=torch.long),
            **{f"module.{k}": v for k, v in model.module.state_dict().items()},
        }
        out = [f"its state['averaged']: {d}" for d in state_dict_differences(expected, state["averaged"])]
        weights = state.get("training_weights")
        if weights is not None:
            n = len(list(model.module.parameters())) + (len(list(model.module.buffers())) if self.use_buffers else 0)
            if len(weights) != n:
                out.append(
                    f"its state['training_weights'] holds {len(weights)} tensors, the module's {n} averaged ones"
                )
        return out

    def _load(self, state: dict[str, Any]) -> None:
        averaged = self.averaged_model
        if averaged is None:
            raise RuntimeError(f"{type(self).__name__}: no average to load into; it is built at on_train_begin.")
        averaged.load_state_dict(state["averaged"])
        self._last_step = int(state["last_step"])
        count = state.get("num_averaged")
        self.num_averaged = int(averaged.n_averaged) if count is None else int(count)  # once, at load
        if state.get("training_weights") is not None:  # saved with the average swapped in
            if self._swap is not None:
                self._swap.keep()  # the module's weights are the loaded ones: nothing set aside still holds
            current = [c for _, cs in self._layout.pairs for c in cs]
            copy_tensors(current, [t.to(c.device) for t, c in zip(state["training_weights"], current, strict=True)])

    # -- hooks -------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        _refuse_fsdp(self.model, type(self).__name__)
        restored, self._restored = self._restored, False
        self._in_fit = True
        module = self.model.module
        if (restored and self._pending is None or self._continues) and self.averaged_model is not None:
            self._group(module)  # loaded into the existing average, or the average goes on (Keras' optimizer EMA)
            return
        self._build(module)
        if self._layout.pairs:  # a broken function is refused now, not at the second update
            try_average_fn(
                type(self).__name__,
                self.avg_fn,
                self.multi_avg_fn,
                self._layout.pairs[0][0][0],
                self._layout.pairs[0][1][0],
            )
        self._last_step = self.model.global_step
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load(state)
        elif self._copy_at_start and self.update_starting_at_step is None and self.update_starting_at_epoch is None:
            self.update()  # the first update copies: the average starts at the weights of step 0

    def on_train_batch_end(self, batch, logs=None):
        step = self.model.global_step
        if step != self._last_step:  # an optimizer step ran
            self._last_step = step
            if self.should_update(step_idx=step - 1):
                self.update()
                self._after_update(step)

    def _after_update(self, step: int) -> None:
        """Subclasses: what follows an update at ``global_step`` ``step``."""

    def on_epoch_begin(self, epoch, logs=None):
        if self._swap is not None:
            self._swap.take_out()  # training runs on the training weights, whoever swapped them out

    def on_epoch_end(self, epoch, logs=None):
        if self.should_update(epoch_idx=epoch):
            self.update()

    def on_test_begin(self, logs=None):
        if self._in_fit and self.evaluate_with_average:
            self._give_back_test = self.lend_average()

    def on_test_end(self, logs=None):
        give_back, self._give_back_test = self._give_back_test, no_swap
        give_back()

    def on_train_end(self, logs=None):
        self._in_fit, self._give_back_test, self._swapped_at_end = False, no_swap, False
        swap = self._swap
        if swap is not None and swap.holder is self:
            swap.keep()  # swapped in at the last epoch end (SwapEMAWeights(swap_on_epoch=True)): it stays
            return
        if not (self.swap_at_end and self.averaged_model is not None and self.num_averaged > 0):
            return
        restoring = restorer(self.model)
        if restoring is not None:  # the best weights win, in any list order (Keras writes its EMA first)
            say(
                self.verbose,
                f"{type(self).__name__}: {type(restoring).__name__} restores the best weights; "
                "the averaged ones stay in averaged_model.",
            )
            return
        if swap is not None:
            swap.take_out()
        self._copy_average_in()
        self._swapped_at_end = True
        say(self.verbose, f"{type(self).__name__}: the averaged weights are now the module's.")

    def close(self) -> None:
        """A ``fit`` that raised with an average swapped in (in a validation) gets its training weights back."""
        self._in_fit, self._give_back_test = False, no_swap
        if self._swap is not None and self._swap.holder is not None:
            self._swap.take_out()
