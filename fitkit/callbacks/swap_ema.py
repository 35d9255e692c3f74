"""Keras' forms of the EMA: ``compile(use_ema=True, ...)`` (:func:`compiled_ema`) and ``SwapEMAWeights``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fitkit.callbacks.averaging import EMA
from fitkit.callbacks.base import Callback
from fitkit.callbacks.swapping import no_swap
from fitkit.checks import check_bool, check_int, check_number
from fitkit.checks.declared import Option, declare, declared

__all__ = ["SwapEMAWeights", "compiled_ema", "with_compiled_ema"]


_SWAP_EMA_WEIGHTS_OPTIONS = declare(
    "SwapEMAWeights",
    Option("swap_on_epoch", "bool"),
)


class SwapEMAWeights(Callback):
    """Evaluate on the EMA weights (Keras' ``SwapEMAWeights``).

    The EMA is the :class:`EMA` callback of the same ``fit`` or the one
    ``compile(use_ema=True)`` adds. The averaged weights go into ``model.module`` at
    ``on_test_begin`` / ``on_predict_begin`` (so ``evaluate`` and ``predict`` after ``fit``
    use them too) and the training weights come back, bit for bit, at the matching end.
    With ``swap_on_epoch`` the averaged weights are also swapped in at each epoch end, so the
    callbacks after it and the checkpoint writers see them (the training weights come back
    at the next epoch begin, and a checkpoint written then carries them in the EMA's state,
    so it resumes exactly); the module holds the averaged weights when ``fit`` ends, as in
    Keras.

    It swaps through the EMA (:meth:`~fitkit.callbacks.weight_averaging.WeightAveraging.lend_average`),
    so with ``EMA(evaluate_with_ema=True)`` on the same EMA the training weights are still set
    aside once. The EMA is the first one of the fit (``compile(use_ema=True)``'s comes first);
    another averaging callback that validates on its own average is refused before step 1, as
    is, with ``swap_on_epoch``, another one that swaps its average in at the end.

    Args:
        swap_on_epoch: also swap at the epoch ends and back at the epoch begins.

    Raises:
        TypeError: ``swap_on_epoch`` is not a bool.
        ValueError: at ``on_train_begin`` (or evaluate / predict), no EMA to swap with; at
            ``fit``, before step 1, a second average to validate on or to end with.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> _ = torch.nn.init.ones_(model.module.weight)
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True,
        ...               ema_momentum=0.5)
        >>> x, y = torch.ones(1, 1), torch.zeros(1, 1)
        >>> _ = model.fit(x, y, epochs=3, callbacks=[SwapEMAWeights(swap_on_epoch=True)], verbose=0)
        >>> model.module.weight.item()  # Keras' EMA of 0.5, 0.25, 0.125: 0.5 -> 0.375 -> 0.25
        0.25
    """

    @declared(_SWAP_EMA_WEIGHTS_OPTIONS)
    def __init__(self, swap_on_epoch: bool = False):
        super().__init__()
        check_bool("swap_on_epoch", swap_on_epoch)
        self.swap_on_epoch = swap_on_epoch
        self._found: EMA | None = None
        self._give_back_test: Callable[[], None] = no_swap
        self._give_back_epoch: Callable[[], None] = no_swap

    def _ema(self) -> EMA:
        found = [cb for cb in self.model.callbacks if isinstance(cb, EMA)]
        if found:
            self._found = found[0]
        ema = self._found if self._found is not None else getattr(self.model, "compiled_ema", None)
        if ema is None:
            raise ValueError(
                "SwapEMAWeights swaps the module's weights with an EMA of them, and there is none. "
                "Fix: compile(..., use_ema=True), or add an EMA callback to the same fit."
            )
        return ema

    def weight_swaps(self, callbacks: list[Any]) -> tuple[Any, Any]:
        """``(validated, at_end)``: the EMA it validates on, and (``swap_on_epoch``) ends ``fit`` with.

        Read by :func:`fitkit.callbacks.swapping.check_weight_swaps` before step 1: another
        averaging callback that validates on its own average is refused.

        Args:
            callbacks: the callbacks of the ``fit`` about to start (``compile(use_ema=True)``'s
                EMA first, if any).
        """
        ema = next((cb for cb in callbacks if isinstance(cb, EMA)), None)
        return ema, (ema if self.swap_on_epoch else None)

    def _lend(self) -> Callable[[], None]:
        return self._ema().lend_average()  # no_swap: already in, or nothing averaged yet

    def on_train_begin(self, logs=None):
        self._found = None
        self._ema()
        self._give_back_test = self._give_back_epoch = no_swap

    def on_test_begin(self, logs=None):
        self._give_back_test = self._lend()

    def on_test_end(self, logs=None):
        give_back, self._give_back_test = self._give_back_test, no_swap
        give_back()

    on_predict_begin = on_test_begin
    on_predict_end = on_test_end

    def on_epoch_begin(self, epoch, logs=None):
        give_back, self._give_back_epoch = self._give_back_epoch, no_swap
        give_back()

    def on_epoch_end(self, epoch, logs=None):
        if self.swap_on_epoch and self._give_back_epoch is no_swap:
            self._give_back_epoch = self._lend()

    def on_train_end(self, logs=None):
        self._give_back_epoch = no_swap  # the EMA's on_train_end keeps the averaged weights in the module

    @contextmanager
    def scored_weights(self, monitor: str) -> Iterator[None]:
        """Inside the block a ``val_`` key's weights (the EMA's) are in ``model.module``."""
        give_back = self._lend() if monitor.startswith("val_") else no_swap
        try:
            yield
        finally:
            give_back()


def compiled_ema(use_ema: bool, ema_momentum: float, ema_overwrite_frequency: int | None) -> EMA | None:
    """The EMA of ``compile(use_ema=True, ...)``, with Keras' optimizer semantics (or ``None``).

    After each optimizer step ``average = m * average + (1 - m) * weights`` with ``m =
    ema_momentum``, except the first step, whose weights the average copies; the parameters
    only (trainable variables); validation in ``fit`` on the training weights; every
    ``ema_overwrite_frequency`` steps the weights become the average; at the end of ``fit``
    they become the average (Keras' ``finalize_variable_values``), unless
    ``EarlyStopping(restore_best_weights=True)`` restores the best weights (Keras writes the EMA
    before ``on_train_end``, so the restore wins there too). The average lives on into the next
    ``fit`` of the same compile, as the optimizer's does in Keras. An ``EMA`` callback may join
    it (validation then runs on the callback's average) if it does not swap in at the end too;
    ``SWA`` or a second end swap is refused before step 1.

    Raises:
        TypeError: ``use_ema`` not a bool, ``ema_momentum`` not a number, the frequency not an int.
        ValueError: ``ema_momentum`` outside ``[0, 1]``, a frequency below 1.

    Example:
        >>> compiled_ema(False, 0.99, None) is None, compiled_ema(True, 0.9, 10).decay
        (True, 0.9)
    """
    check_bool("use_ema", use_ema)
    check_number("ema_momentum", ema_momentum, minimum=0.0)
    if ema_momentum > 1:
        raise ValueError(f"Expected `ema_momentum` in [0, 1]. Received: ema_momentum={ema_momentum!r}.")
    check_int("ema_overwrite_frequency", ema_overwrite_frequency, 1, allow_none=True)
    if not use_ema:
        return None
    ema = EMA(
        decay=ema_momentum,
        evaluate_with_ema=False,
        swap_at_end=True,
        use_buffers=False,
        update_starting_at_step=0,
        overwrite_every_n_steps=ema_overwrite_frequency,
    )
    ema._continues = True  # the optimizer's average lives on across fit calls, as in Keras
    return ema


def with_compiled_ema(ema: EMA | None, callbacks: Any) -> Any:
    """``callbacks`` with ``compile(use_ema=True)``'s EMA first (anything else is left to the checks).

    Example:
        >>> with_compiled_ema(None, None) is None, len(with_compiled_ema(EMA(), []))
        (True, 1)
    """
    if ema is None or not (callbacks is None or isinstance(callbacks, (list, tuple))):
        return callbacks
    return [ema, *(callbacks or [])]
