"""One swap of the module's weights at a time: the protocol every averaging callback shares.

Averaging callbacks (``EMA``, ``SWA``, ``WeightAveraging``, ``compile(use_ema=True)``'s EMA,
and ``SwapEMAWeights`` through its EMA) put averaged weights into ``model.module`` for a
while: for a validation, for a best-weights snapshot (:mod:`fitkit.callbacks.scoring`), from
an epoch end to the next epoch begin. Were each swap to set aside whatever it found, two would
nest: the second would set aside the first one's average as "the training weights", and
training would go on from it. So one :class:`WeightSwap` per module holds the training
weights while any averaged copy is in the module: they are set aside once, when a copy goes
in, and come back once, bit for bit, when it goes out; a second copy replaces the first one
(the training weights come back in between), never stacks on it. An average that is updated,
or a Keras-style overwrite, while a copy is in reads and writes the training weights where
they are set aside, so training never continues from an average it did not ask for.

Which copy a validation runs on has one answer only when one callback asks:
:func:`check_weight_swaps` refuses, before step 1 (nothing changed), a fit whose callbacks
would validate on two different averages, or put two different averages into the module when
``fit`` ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["WeightSwap", "weight_swap", "no_swap", "state_tensors", "copy_tensors", "check_weight_swaps", "restorer"]

Tensors = list[torch.Tensor]


def state_tensors(module: nn.Module) -> Tensors:
    """The module's parameters, then its buffers, detached (the order of a :class:`WeightSwap`).

    Example:
        >>> [tuple(t.shape) for t in state_tensors(torch.nn.BatchNorm1d(2))]
        [(2,), (2,), (2,), (2,), ()]
    """
    return [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]


def no_swap() -> None:
    """What :meth:`WeightSwap.lend` gives back when nothing was swapped: nothing to undo."""


@torch.no_grad()
def copy_tensors(dst: Tensors, src: Tensors) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, in one foreach call (nothing for empty lists)."""
    if dst:
        torch._foreach_copy_(dst, src)


class WeightSwap:
    """The training weights of one module while an averaged copy is in it (one per module).

    :func:`weight_swap` gives the module's one instance. A holder (an averaging callback)
    puts its copy in with :meth:`put` or :meth:`lend`: the module's parameters and buffers
    (:func:`state_tensors`) are cloned once, on their device, then the holder's ``copy_in``
    writes its weights into the module. :meth:`take_out` copies the training weights back,
    bit for bit; :meth:`keep` lets the module keep the copy (the end of ``fit``). Putting a
    second holder's copy in first takes the first one out, so the training weights are never
    set aside twice.

    Attributes:
        holder: whose copy is in the module (``None``: the training weights are).
        saved: the training weights (:func:`state_tensors` order) while a copy is in, else ``None``.

    Example:
        >>> module = torch.nn.Linear(1, 1, bias=False)
        >>> _ = torch.nn.init.ones_(module.weight)
        >>> swap = weight_swap(module)
        >>> give_back = swap.lend("ema", lambda: module.weight.data.fill_(0.5))
        >>> swap.holder, module.weight.item()
        ('ema', 0.5)
        >>> give_back(); swap.holder, module.weight.item()
        (None, 1.0)
    """

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)  # the registry's key: a strong reference would keep it alive
        self.holder: Any = None
        self.saved: Tensors | None = None
        self._copy_in: Callable[[], Any] | None = None

    def _tensors(self) -> Tensors:
        module = self._module()
        return [] if module is None else state_tensors(module)

    def put(self, holder: Any, copy_in: Callable[[], Any]) -> None:
        """Put ``holder``'s copy into the module (nothing if it is in already).

        Args:
            holder: the object whose weights go in (an averaging callback).
            copy_in: writes its weights into the module's tensors, in place.
        """
        if self.holder is holder:
            return
        self.take_out()  # another copy is in: the training weights come back first
        self.saved = [t.clone() for t in self._tensors()]  # device copies: no host sync
        self.holder, self._copy_in = holder, copy_in
        copy_in()

    def take_out(self) -> None:
        """Put the training weights back, bit for bit (nothing if they are in)."""
        if self.holder is None:
            return
        saved = self.saved or []
        self.holder, self.saved, self._copy_in = None, None, None
        copy_tensors(self._tensors(), saved)

    def keep(self) -> None:
        """Let the module keep the copy it holds: the training weights set aside are dropped."""
        self.holder, self.saved, self._copy_in = None, None, None

    def lend(self, holder: Any, copy_in: Callable[[], Any]) -> Callable[[], None]:
        """Put ``holder``'s copy in for a while; the function returned puts back what was in.

        Args:
            holder: the object whose weights go in.
            copy_in: writes its weights into the module's tensors, in place.

        Returns:
            A function to call once the copy has served (a second call does nothing, nor
            does one after the copy was kept, taken out or replaced meanwhile). If
            ``holder``'s copy was in already, it is :func:`no_swap`: whoever put it in takes
            it out.
        """
        before, before_copy = self.holder, self._copy_in
        if before is holder:
            return no_swap
        self.put(holder, copy_in)

        def give_back() -> None:
            if self.holder is not holder:
                return
            if before is None or before_copy is None:
                self.take_out()
            else:
                self.put(before, before_copy)

        return give_back


_SWAPS: weakref.WeakKeyDictionary[nn.Module, WeightSwap] = weakref.WeakKeyDictionary()


def weight_swap(module: nn.Module) -> WeightSwap:
    """The one :class:`WeightSwap` of ``module``, shared by every callback that swaps its weights.

    Example:
        >>> module = torch.nn.Linear(1, 1)
        >>> weight_swap(module) is weight_swap(module)
        True
    """
    swap = _SWAPS.get(module)
    if swap is None:
        swap = _SWAPS[module] = WeightSwap(module)
    return swap


def restorer(model: Model) -> Any:
    """The callback of the running ``fit`` that puts best weights back when it ends, or ``None``.

    A callback says so with a true ``restores_weights_at_end`` (``EarlyStopping`` with
    ``restore_best_weights=True`` once it has a best epoch). An averaging callback's swap at
    the end then yields to it, in whichever order the two are listed: the weights the user
    asked to restore are the ones the module holds after ``fit`` (as in Keras, whose optimizer
    EMA is written before any ``on_train_end``).
    """
    return next((cb for cb in model.callbacks if getattr(cb, "restores_weights_at_end", False)), None)


def _name(model: Model, callbacks: list[Any], cb: Any) -> str:
    compiled = getattr(model, "compiled_ema", None)
    if cb is compiled:
        return "compile(use_ema=True)'s EMA"
    offset = 1 if compiled is not None and callbacks and callbacks[0] is compiled else 0
    i = next((i for i, c in enumerate(callbacks) if c is cb), None)
    return type(cb).__name__ if i is None else f"{type(cb).__name__} (callbacks[{i - offset}])"


_WHY = (
    "would each swap their averaged weights into the module for validation. A validation scores one "
    "set of weights, so the val_ keys (and what EarlyStopping / ModelCheckpoint keep) could not say "
    "which average they scored. Fix: keep one averaging callback, or let one validate on its average: "
    "pass evaluate_with_ema=False to the other EMAs, evaluate_with_average=False to the other "
    "WeightAveraging callbacks, and use SwapEMAWeights only with the EMA that validates.",
    "would each put their averaged weights into the module when fit ends, and the later one in the "
    "list would silently replace the other. Fix: keep one averaging callback, or pass swap_at_end=False "
    "to all but one (SWA and compile(use_ema=True)'s EMA always swap at the end; "
    "SwapEMAWeights(swap_on_epoch=True) leaves its EMA in).",
)


def check_weight_swaps(model: Model, callbacks: list[Any], validates: bool = True) -> None:
    """``ValueError`` when two averages would be swapped into the module for one purpose.

    A callback that swaps weights says which average it puts in with
    ``weight_swaps(callbacks) -> (validated, at_end)``: the averaging callback whose weights
    the validation inside ``fit`` runs on, and the one whose weights the module holds when
    ``fit`` ends (``None`` for none). Several callbacks may name the same average
    (``SwapEMAWeights`` and its ``EMA``); two different ones for either purpose have no
    sensible meaning, so ``fit`` refuses them before step 1 (weights and optimizer as they
    were).

    Args:
        model: the :class:`fitkit.Model`.
        callbacks: the call's callbacks (``compile(use_ema=True)``'s EMA first, if any).
        validates: whether the ``fit`` validates (else nothing is validated on, and only the
            end of ``fit`` is checked).

    Raises:
        ValueError: two averages validated on, or two swapped in at the end; the message
            names both callbacks and the fix.

    Example:
        >>> import fitkit
        >>> from fitkit.callbacks import EMA
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> check_weight_swaps(model, [EMA(), EMA(evaluate_with_ema=False)])  # one validates: fine
        >>> check_weight_swaps(model, [EMA(), EMA()])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected at most one averaged copy of the weights to validate on. Received 2: ...
    """
    for purpose, why in enumerate(_WHY):
        if purpose == 0 and not validates:
            continue
        found: list[tuple[Any, str]] = []
        for cb in callbacks:
            swaps = getattr(cb, "weight_swaps", None)
            averager = swaps(callbacks)[purpose] if callable(swaps) else None
            if averager is None or any(a is averager for a, _ in found):
                continue
            who = _name(model, callbacks, cb)
            if averager is not cb:
                who += f" with {_name(model, callbacks, averager)}"
            found.append((averager, who))
        if len(found) > 1:
            what = "to validate on" if purpose == 0 else "to put into the module when fit ends"
            names = [who for _, who in found]
            raise ValueError(
                f"Expected at most one averaged copy of the weights {what}. Received {len(found)}: "
                f"{', '.join(names[:-1])} and {names[-1]} {why}"
            )
