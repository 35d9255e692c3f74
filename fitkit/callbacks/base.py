"""The callback protocol: ``Callback``, the fan-out ``CallbackList``, and ``History``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from fitkit.files import to_python

__all__ = ["Callback", "CallbackList", "History", "BatchLogs", "HOOKS"]

#: The names of the callback hooks, in the order of the :class:`Callback` protocol.
HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_backward_end",
    "on_validation_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class Callback:
    """Base class of fitkit callbacks: override the hooks you need (Keras names, 0-based).

    ``self.model`` is the :class:`fitkit.Model` and ``self.params`` holds ``epochs``, ``steps``
    (batches per epoch, ``None`` when unknown) and ``verbose``. Epoch logs hold Python floats;
    batch logs hold detached 0-dim tensors (running epoch means), computed only when read, so
    a callback that does not read them costs no host sync.

    ``state_dict()`` / ``load_state_dict()`` carry what a callback needs to resume; they are
    saved in checkpoints.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print(f"epoch {epoch}: loss {logs['loss']:.3f}")
        >>> PrintLoss().on_epoch_end(0, {"loss": 0.5})
        epoch 0: loss 0.500
    """

    #: Whether this callback's :meth:`on_backward_end` vetoes steps on the device only
    #: (``model.skip_optimizer_step(when=tensor)``), never on the host (``skip_optimizer_step()``
    #: without ``when``), and leaves a ``stop_training`` it sets inside an epoch to be taken
    #: where the ranks agree anyway. Under torchrun, when every ``on_backward_end`` callback
    #: says so, the stepper skips its per-step host agreement (one all-reduce and one host read
    #: per step): the device veto is all-reduced on the device, and a stop is agreed at the
    #: signal agreement points (:class:`fitkit.training.signals.RankAgreement`) or at the epoch end.
    #: ``TerminateOnNaN`` sets it.
    device_veto_only: bool = False

    #: Whether ``fit(fast_dev_run=...)`` leaves this callback out: it writes files
    #: (checkpoints, backups, logs, traces) or tunes before training (the LR and batch-size
    #: finders), which a smoke test must not do. Set it on a callback of your own that writes.
    skip_in_fast_dev_run: bool = False

    #: A resource of the whole process this callback holds while ``fit`` runs (``None``: none),
    #: as a short description, e.g. ``"torch.profiler"``: ``fit`` refuses two callbacks that hold
    #: the same one before step 1 (two torch profilers in one process crash it), and asks the
    #: callback's ``resource_in_use()`` (if it has one) whether it is taken already.
    process_resource: str | None = None

    #: Whether this callback writes the run's backup (``BackupAndRestore``): in each event the
    #: callback list runs the backup writers after the other checkpoint writers, so a backup
    #: taken at a point holds the other files of that point.
    is_backup: bool = False

    #: What the fit loop asks of a callback beyond its hooks is declared here, with defaults that
    #: mean "nothing": the core calls these on every callback and never probes with ``getattr``.

    def accumulation_for(self, compiled: int) -> Any:
        """This fit's gradient-accumulation schedule by epoch (``GradientAccumulationScheduler``),
        with ``compiled`` for the epochs before its first key; ``None``: the callback has none."""
        return None

    def resource_in_use(self) -> str | None:
        """Why :attr:`process_resource` is taken already (another torch profiler runs), else ``None``."""
        return None

    def time_due(self) -> bool:
        """Whether this callback's clock trigger is due on this rank (:meth:`acts_on_time` callbacks)."""
        return False

    def time_agreed(self) -> None:
        """Called on every rank at the step where the ranks agreed a clock trigger was due on any."""

    @property
    def acts_on_time(self) -> bool:
        """Whether this callback has a clock trigger (it overrides :meth:`time_agreed`): under torchrun
        the fit agrees its time over the ranks (``ModelCheckpoint(train_time_interval=...)``)."""
        return type(self).time_agreed is not Callback.time_agreed

    def loaded_by_fit(self) -> None:
        """Called after the fit itself loaded this callback's state (a resume point applied after
        ``on_train_begin``): a callback that keeps a loaded state for its next ``on_train_begin``
        drops that flag here."""

    def watches(self) -> dict[str, str]:
        """What this callback's saved state means: the key it monitors and the direction
        (``{"monitor": ..., "mode": ...}``; empty for a callback without them). A resume that
        watches another key does not restore the state."""
        return {k: str(getattr(self, k)) for k in ("monitor", "mode") if isinstance(getattr(self, k, None), str)}

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Set ``self.model``; called by :class:`CallbackList` before any hook runs.

        Args:
            model: the :class:`fitkit.Model` being trained, evaluated or run.
        """
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Set ``self.params``; called by :class:`CallbackList` before any hook runs.

        Args:
            params: ``epochs`` (``None`` in ``evaluate`` / ``predict``), ``steps`` (batches
                per epoch, ``None`` when unknown), ``verbose`` and, in ``fit``,
                ``do_validation`` and ``train_data`` (an iterable of the training batches
                ``(x, y, sample_weight)``, on the device); one dict, shared by every
                callback of the call.
        """
        self.params = params

    def state_dict(self) -> dict[str, Any]:
        """What this callback needs to resume (plain Python values and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def on_train_begin(self, logs=None):
        """Called once per ``fit``, before the first epoch; ``logs`` is an empty dict."""

    def on_train_end(self, logs=None):
        """Called once per ``fit``, after the last epoch run (early stops included).

        ``logs`` holds the last epoch's logs, as in :meth:`on_epoch_end` (``{}`` if none ran).
        """

    def on_epoch_begin(self, epoch, logs=None):
        """Called at the start of each epoch (``epoch``: 0-based index); ``logs`` is empty."""

    def on_epoch_end(self, epoch, logs=None):
        """Called after each epoch (``epoch``: 0-based index) and its validation, if any.

        ``logs`` holds Python floats: ``loss``, the metrics, ``learning_rate`` and, on epochs
        that validate, ``val_`` keys. Keys a callback adds are seen by later callbacks.
        """

    def on_train_batch_begin(self, batch, logs=None):
        """Called before each training batch (``batch``: 0-based index in the epoch).

        ``logs`` is an empty dict.
        """

    def on_train_batch_end(self, batch, logs=None):
        """Called after each training batch (``batch``: 0-based index in the epoch).

        ``logs`` is a :class:`BatchLogs` of running epoch means (``loss``, metrics): detached
        0-dim tensors on the model's device, computed only when a key is read.
        """

    def on_backward_end(self, batch):
        """Called after the backward pass of each batch that steps, before the optimizer step.

        Gradients are unscaled (mixed precision) and not yet clipped; with gradient accumulation
        only the last batch of each group steps. ``batch``: 0-based index in the epoch; no logs.
        """

    def on_validation_end(self, logs=None):
        """Called after each validation inside ``fit``: every ``validation_interval`` optimizer
        steps (inside the epoch, before that batch's ``on_train_batch_end``), or at the epoch
        end (after ``on_test_end``, before ``on_epoch_end``).

        ``logs`` is the validation's record, also appended to ``History.validations``:
        ``epoch`` (0-based), ``step`` (``global_step`` when it was taken) and the ``val_``
        values (Python floats). Monitoring callbacks with a ``val_`` monitor act here when fit
        validates inside epochs (:mod:`fitkit.training.step_validation`).
        """

    def on_test_begin(self, logs=None):
        """Called at the start of ``evaluate`` and of each validation in ``fit``.

        ``logs`` is an empty dict.
        """

    def on_test_end(self, logs=None):
        """Called at the end of ``evaluate`` or of a validation in ``fit``.

        ``logs`` holds Python floats (``loss``, metrics), without the ``val_`` prefix.
        """

    def on_test_batch_begin(self, batch, logs=None):
        """Called before each evaluation batch (``batch``: 0-based index); ``logs`` is empty."""

    def on_test_batch_end(self, batch, logs=None):
        """Called after each evaluation batch (``batch``: 0-based index).

        ``logs`` is a :class:`BatchLogs` as in :meth:`on_train_batch_end`: running means of this
        evaluation (or validation) so far, detached 0-dim tensors, computed only if read.
        """

    def on_predict_begin(self, logs=None):
        """Called at the start of ``predict``; ``logs`` is an empty dict."""

    def on_predict_end(self, logs=None):
        """Called at the end of ``predict``; ``logs`` is an empty dict."""

    def on_predict_batch_begin(self, batch, logs=None):
        """Called before each prediction batch (``batch``: 0-based index); ``logs`` is empty."""

    def on_predict_batch_end(self, batch, logs=None):
        """Called after each prediction batch (0-based ``batch``).

        ``logs["outputs"]`` is that batch's module output, on the model's device (float32
        under mixed precision).
        """

    def close(self) -> None:
        """Release files, writers and threads; called once ``fit`` is over, also when it raises.

        Runs after ``on_train_end`` (or instead of it when ``fit`` raises). Idempotent.
        """

    # Internal: run after every callback's on_train_batch_end / on_epoch_end for the same
    # event, so a checkpoint written here holds every callback's updated state and the
    # history of that epoch (ModelCheckpoint, BackupAndRestore); at a SIGTERM / SIGINT, at the
    # step boundary where fit stops (BackupAndRestore); when fit raises after a step
    # (ModelCheckpoint(save_on_exception=...)).
    def _save_on_batch_end(self, batch, logs=None): ...
    def _save_on_epoch_end(self, epoch, logs=None): ...
    def _save_on_validation_end(self, logs=None): ...
    def _save_on_interrupt(self): ...
    def _save_on_exception(self): ...


class BatchLogs(MutableMapping):
    """Batch-level logs whose values are computed on first read.

    The running epoch means are 0-dim tensors on the model's device; computing them costs a
    few kernel launches, so they are computed once per event, and only if a callback reads a
    key. Keys a callback sets are kept as they are.

    Example:
        >>> logs = BatchLogs(lambda: {"loss": torch.tensor(0.25)})
        >>> logs["lr_x10"] = 1.0
        >>> sorted(logs), float(logs["loss"])
        (['loss', 'lr_x10'], 0.25)
    """

    __slots__ = ("_compute", "_data")

    def __init__(self, compute: Callable[[], dict[str, torch.Tensor]]):
        self._compute: Callable[[], dict[str, torch.Tensor]] | None = compute
        self._data: dict[str, Any] = {}

    def _resolved(self) -> dict[str, Any]:
        if self._compute is not None:
            extra, self._data = self._data, self._compute()
            self._data.update(extra)
            self._compute = None
        return self._data

    def __getitem__(self, key: str) -> Any:
        if key in self._data:
            return self._data[key]
        return self._resolved()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._resolved()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def __repr__(self) -> str:
        return f"BatchLogs({self._resolved()!r})"


class History(Callback):
    """Records epoch logs: ``history.history[key]`` is a list of floats, one per epoch run.

    Added to every ``fit`` and returned by it (also ``model.history``). ``history.validations``
    lists every validation of the fit, step-level (``validation_interval``) or at an epoch end,
    as ``{"epoch": int, "step": global_step, "val_<key>": float, ...}``, in the order they ran.

    Example:
        >>> h = History()
        >>> h.on_epoch_end(0, {"loss": 1.0}); h.on_epoch_end(1, {"loss": 0.5})
        >>> h.history, h.epoch
        ({'loss': [1.0, 0.5]}, [0, 1])
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.validations: list[dict[str, Any]] = []  # record_validation, called by the fit loop

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():  # Python numbers, so a checkpoint loads back
            self.history.setdefault(key, []).append(to_python(value))

    def record_validation(self, record: dict[str, Any]) -> None:
        """Keep a validation's record (``epoch``, ``step``, ``val_*``; before ``on_validation_end``)."""
        self.validations.append(dict(record))

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "epoch": list(self.epoch),
            "validations": [{k: to_python(v) for k, v in r.items()} for r in self.validations],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.epoch = list(state["epoch"])
        self.validations = [dict(r) for r in state.get("validations", [])]

    def plot(self, keys: list[str] | None = None, path: str | None = None):
        """Draw learning curves with matplotlib (``pip install ".[plot]"`` from a checkout).

        Args:
            keys: history keys to draw; default: every key but ``learning_rate``, a ``val_``
                key on the same axes as its training key.
            path: if given, the figure is saved there as a PNG.

        Returns:
            The matplotlib ``Figure``.

        Raises:
            ImportError: matplotlib is not installed.
            ValueError: a key that the history does not hold.
            OSError: the PNG cannot be written (a full disk): a file already at ``path`` is
                left as it was, and no temp file stays.

        Example:
            >>> h = History(); h.on_epoch_end(0, {"loss": 1.0}); h.on_epoch_end(1, {"loss": 0.5})
            >>> fig = h.plot()
            >>> [ax.get_title() for ax in fig.axes]
            ['loss']
        """
        try:
            import matplotlib

            if path is not None or matplotlib.get_backend().lower() == "agg":
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "History.plot needs matplotlib. Install the `plot` extra: "
                "`pip install '.[plot]'` from a checkout (`pip install 'torch-fitkit[plot]'` once released)."
            ) from None
        if keys is None:
            keys = [k for k in self.history if not k.startswith("val_") and k != "learning_rate"]
        unknown = [k for k in keys if k not in self.history]
        if unknown:
            raise ValueError(f"Unknown history keys {unknown}. Available: {sorted(self.history)}.")
        fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4 * max(len(keys), 1), 3), squeeze=False)
        epochs = [e + 1 for e in self.epoch]
        for ax, key in zip(axes[0], keys, strict=False):
            ax.plot(epochs, self.history[key], marker="o", label=key)
            if f"val_{key}" in self.history:
                ax.plot(epochs, self.history[f"val_{key}"], marker="o", label=f"val_{key}")
            ax.set_title(key)
            ax.set_xlabel("epoch")
            ax.legend()
        fig.tight_layout()
        try:
            if path is not None:  # a temp file renamed over path: a full disk leaves the old PNG as it was
                from fitkit.files.writing import _atomic_write

                _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
        finally:
            plt.close(fig)
        return fig


def _overrides(cb: Callback, hook: str) -> bool:
    # An instance attribute counts too: LambdaCallback sets only the hooks it was given.
    return hook in vars(cb) or getattr(type(cb), hook, None) is not getattr(Callback, hook)


_SAVE_HOOKS = {
    "on_train_batch_end": "_save_on_batch_end",
    "on_epoch_end": "_save_on_epoch_end",
    "on_validation_end": "_save_on_validation_end",
}
_INTERNAL = ("_save_on_interrupt", "_save_on_exception", "close")


class CallbackList:
    """Fan a hook out to callbacks in list order.

    For each hook only the callbacks that override it are called, so a batch hook nobody
    listens to costs nothing, and :meth:`wants` lets the loop skip building batch logs.

    Example:
        >>> h = History()
        >>> cl = CallbackList([h], model=None, params={"epochs": 1})
        >>> cl.on_epoch_end(0, {"loss": 2.0}); h.history
        {'loss': [2.0]}
    """

    def __init__(self, callbacks: list[Callback], model: Any, params: dict[str, Any]):
        self.callbacks = list(callbacks)
        self.params = params  # shared: every callback's `self.params` is this dict
        for cb in self.callbacks:
            cb.set_model(model)
            cb.set_params(params)
        self._hooks: dict[str, list[Callable[..., Any]]] = {
            hook: [getattr(cb, hook) for cb in self.callbacks if _overrides(cb, hook)] for hook in HOOKS
        }
        # Checkpoint writers, in list order but backups last: a backup then never records a
        # file that another callback has yet to write.
        writers = sorted(self.callbacks, key=lambda cb: cb.is_backup)
        for save in (*_SAVE_HOOKS.values(), *_INTERNAL):
            self._hooks[save] = [getattr(cb, save) for cb in writers if _overrides(cb, save)]

    def wants(self, hook: str) -> bool:
        """Whether any callback overrides ``hook``, so that the loop may skip building its logs.

        Args:
            hook: a hook name, one of ``HOOKS``.

        Returns:
            ``True`` if calling ``hook`` would run at least one callback (for
            ``on_train_batch_end`` and ``on_epoch_end``, a checkpoint writer counts too).

        Raises:
            KeyError: ``hook`` is not a hook name.

        Example:
            >>> cl = CallbackList([History()], model=None, params={})
            >>> cl.wants("on_epoch_end"), cl.wants("on_train_batch_end")
            (True, False)
        """
        return bool(self._hooks[hook]) or (hook in _SAVE_HOOKS and bool(self._hooks[_SAVE_HOOKS[hook]]))

    def host_agreement_after_backward(self) -> bool:
        """Whether an ``on_backward_end`` callback may veto on the host or stop mid-step, so
        that the ranks must agree after that hook on every step (see ``device_veto_only``).

        Example:
            >>> from fitkit.callbacks import TerminateOnNaN, LambdaCallback
            >>> CallbackList([TerminateOnNaN()], model=None, params={}).host_agreement_after_backward()
            False
            >>> hook = LambdaCallback(on_backward_end=lambda batch: None)
            >>> CallbackList([TerminateOnNaN(), hook], model=None, params={}).host_agreement_after_backward()
            True
        """
        return any(not cb.device_veto_only for cb in self.callbacks if _overrides(cb, "on_backward_end"))

    def _call(self, hook: str, *args: Any) -> None:
        for fn in self._hooks[hook]:
            fn(*args)

    def on_train_begin(self, logs=None):
        self._call("on_train_begin", logs)

    def on_train_end(self, logs=None):
        self._call("on_train_end", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._call("on_epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._call("on_train_batch_begin", batch, logs)

    def on_backward_end(self, batch):
        self._call("on_backward_end", batch)

    def on_test_begin(self, logs=None):
        self._call("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._call("on_test_end", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._call("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._call("on_test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        self._call("on_predict_begin", logs)

    def on_predict_end(self, logs=None):
        self._call("on_predict_end", logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._call("on_predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._call("on_predict_batch_end", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._call("on_train_batch_end", batch, logs)
        self._call("_save_on_batch_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._call("on_epoch_end", epoch, logs)
        self._call("_save_on_epoch_end", epoch, logs)

    def on_validation_end(self, logs=None):
        self._call("on_validation_end", logs)
        self._call("_save_on_validation_end", logs)

    def save_on_interrupt(self) -> None:
        """At a SIGTERM / SIGINT during fit: let backups write the state of this step boundary."""
        self._call("_save_on_interrupt")

    def save_on_exception(self) -> None:
        """``fit`` raised after a step: let the callbacks that ask write a checkpoint first."""
        self._call("_save_on_exception")

    @property
    def backs_up(self) -> bool:
        """Whether a callback writes a backup at a SIGTERM / SIGINT (a ``BackupAndRestore``)."""
        owners = (getattr(fn, "__self__", None) for fn in self._hooks["_save_on_interrupt"])
        return any(cb is not None and cb.is_backup for cb in owners)  # not a ModelCheckpoint noting the stop

    def close(self, finished: bool = True) -> None:
        """Call every callback's :meth:`Callback.close`, each even if another one raises.

        Args:
            finished: whether ``fit`` ended normally (``on_train_end`` ran).
        """
        errors = []
        for fn in self._hooks["close"]:
            try:
                fn()
            except Exception as e:  # close the rest first; the first error is not lost
                errors.append(e)
        if errors and finished:
            raise errors[0]
