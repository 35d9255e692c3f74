"""``OptunaPruning``: report a monitored value to an Optuna trial and prune (the ``optuna`` extra)."""

from __future__ import annotations

import importlib.util
from typing import Any

from fitkit.callbacks.base import Callback
from fitkit.callbacks.monitor import check_validation_monitor, monitor_value
from fitkit.checks import check_int
from fitkit.checks.declared import Option, declare, declared
from fitkit.formatting import format_value

__all__ = ["OptunaPruning"]


_OPTUNA_PRUNING_OPTIONS = declare(
    "OptunaPruning",
    Option("trial", "custom", checked_in="OptunaPruning.__init__", bad=(5, "trial")),
    Option("monitor", "text"),
    Option("interval", "int", minimum=1),
)


class OptunaPruning(Callback):
    """Report ``monitor`` to an Optuna trial after each epoch; stop the trial when it is pruned.

    After each epoch the monitored value goes to ``trial.report(value, step=epoch)`` (0-based
    epoch; an epoch that runs no validation, with ``validation_freq`` > 1, reports nothing).
    When the study's pruner then says so (``trial.should_prune()``), the callback raises
    ``optuna.TrialPruned``: ``fit`` ends by that exception, with the module's train / eval
    flags and the grad mode restored, and ``study.optimize`` records the trial as ``PRUNED``.
    Optuna's own Keras and Lightning callbacks work the same way. Callbacks run in list order,
    so put this one after the loggers (``CSVLogger``, ``TensorBoard``, ``MLflowLogger``): they
    then record the epoch that got the trial pruned.

    Under ``torchrun`` every process reports the same value (the History is the same on every
    rank); give each process the trial through ``optuna.integration.TorchDistributedTrial`` so
    that only rank 0 writes to the study.

    Args:
        trial: the ``optuna.trial.Trial`` of the objective function.
        monitor: the epoch log key to report, e.g. ``"val_loss"`` or ``"val_accuracy"``;
            the study's ``direction`` must match it (minimize a loss, maximize an accuracy).
        interval: report and decide every n-th epoch only, counted 1-based: epochs n, 2n, ...
            (Optuna's ``KerasPruningCallback(interval=n)``).

    Raises:
        ImportError: optuna is not installed (``pip install ".[optuna]"`` from a checkout).
        TypeError: ``trial`` has no ``report`` / ``should_prune`` methods, ``interval`` is
            not an int.
        ValueError: ``interval`` < 1.
        ValueError: at ``on_train_begin``, a ``val_`` monitor without validation data, or a
            ``monitor`` no log will hold; at the first epoch end, when another callback may add
            keys (:func:`~fitkit.callbacks.logkeys.may_add_keys`), a ``monitor`` the logs do not
            hold.

    Example:
        >>> import optuna, torch, fitkit
        >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
        >>> def objective(trial):
        ...     model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        ...     model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=trial.suggest_float("lr", 0.01, 0.1)),
        ...                   loss="mse")
        ...     x = torch.linspace(-1, 1, 16).unsqueeze(1)
        ...     history = model.fit(x, 2 * x, epochs=3, verbose=0, callbacks=[OptunaPruning(trial, "loss")])
        ...     return history.history["loss"][-1]
        >>> study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
        >>> study.optimize(objective, n_trials=2)
        >>> [sorted(t.intermediate_values) for t in study.trials]
        [[0, 1, 2], [0, 1, 2]]
        >>> trial = study.ask()
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> _ = model.fit(torch.ones(4, 1), torch.ones(4, 1), epochs=5, verbose=0,
        ...               callbacks=[OptunaPruning(trial, "loss", interval=2)])
        >>> sorted(study.trials[-1].intermediate_values)  # epochs 2 and 4 (1-based)
        [1, 3]
    """

    skip_in_fast_dev_run = True  # it reports to a study: fit(fast_dev_run=...) leaves it out

    @declared(_OPTUNA_PRUNING_OPTIONS)
    def __init__(self, trial: Any, monitor: str = "val_loss", interval: int = 1):
        super().__init__()
        if importlib.util.find_spec("optuna") is None:
            raise ImportError(
                "OptunaPruning needs optuna. Install the `optuna` extra: "
                "`pip install '.[optuna]'` from a checkout (`pip install 'torch-fitkit[optuna]'` once released)."
            )
        if not (callable(getattr(trial, "report", None)) and callable(getattr(trial, "should_prune", None))):
            raise TypeError(
                "Expected `trial` to be an optuna Trial (with `report` and `should_prune`). "
                f"Received: {type(trial).__name__}. Fix: pass the trial that the objective receives."
            )
        if not isinstance(monitor, str):
            raise TypeError(f"Expected `monitor` to be a log key (str). Received: monitor={monitor!r}.")
        check_int("interval", interval, 1)
        self.trial, self.monitor, self.interval = trial, monitor, interval

    def on_train_begin(self, logs=None):
        check_validation_monitor(self.monitor, self.params, "OptunaPruning", self.model)

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.interval:
            return
        value = monitor_value(logs, self.monitor, "OptunaPruning", self.params, self.model)
        if value is None:  # no validation this epoch
            return
        self.trial.report(value, step=epoch)
        if self.trial.should_prune():
            import optuna

            shown = format_value(self.monitor, value)
            raise optuna.TrialPruned(f"Trial pruned at epoch {epoch} ({self.monitor}={shown}).")
