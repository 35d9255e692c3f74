"""``MLflowLogger``: log a fit's parameters, metrics and files to MLflow (the ``mlflow`` extra)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.mlflow_store import local_sqlite_dir, store_lock
from fitkit.callbacks.monitor import StatefulCallback
from fitkit.checks import FitkitWarning, check_bool
from fitkit.checks.declared import Option, declare, declared
from fitkit.checks.options import check_tags
from fitkit.distributed.group import is_rank_zero
from fitkit.files.preflight import check_writable

__all__ = ["MLflowLogger"]

# Metric keys of the per-step logs; the epoch logs keep their own names (as TensorBoard's).
_BATCH_PREFIX = "batch_"


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()  # a batch log: one host sync, only when a step is logged
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


_MLFLOW_LOGGER_OPTIONS = declare(
    "MLflowLogger",
    Option(
        "tracking_uri",
        "text",
        allow_none=True,
        fix="pass a URI such as 'sqlite:///mlflow.db' or 'http://host:5000', or None for MLFLOW_TRACKING_URI or "
        "./mlflow.db.",
    ),
    Option(
        "experiment_name", "text", allow_none=True, fix="pass the experiment's name, e.g. experiment_name='digits'."
    ),
    Option("run_name", "text", allow_none=True, fix="pass the run's display name, e.g. run_name='baseline'."),
    Option("log_every_n_steps", "custom", checked_in="__init__", bad=(0, -1, 1.5, "10", True)),
    Option("checkpoint", "custom", checked_in="MLflowLogger.__init__", bad=(5,)),
    Option("log_plot", "bool"),
    Option("tags", "custom", check=lambda v: check_tags("tags", v, "tags={'team': 'vision'}"), bad=(["a"], {1: "x"})),
)


class MLflowLogger(StatefulCallback):
    """Log a fit to MLflow: parameters, per-epoch metrics, the best checkpoint and the curves.

    One ``fit`` is one MLflow run. When it starts, the run gets the parameters that ``compile``
    and ``fit`` set: ``optimizer`` (class name), ``lr`` (of the first param group),
    ``batch_size`` (when fit knows it), ``epochs``, ``steps_per_epoch``, ``precision``,
    ``gradient_accumulation_steps``, ``num_params`` (parameters, shared ones once), ``module``
    and ``loss``. After each epoch every numeric log (``loss``, metrics, ``val_*``,
    ``learning_rate``) is logged with ``step=epoch`` (0-based); with ``log_every_n_steps`` the
    running means of the batch logs are also logged as ``batch_<key>`` with ``step`` the
    optimizer step (``model.global_step``), every that many steps (reading them syncs with the
    device, once per logged step). With ``fit(validation_interval=...)`` each validation is
    logged as ``step_val_<key>`` with ``step`` its ``global_step``. At the end the run gets,
    as artifacts, the ``History.plot`` PNG (``history.png``, needs matplotlib) and the best
    checkpoint (``checkpoints/<file>``): ``checkpoint`` if given, else the ``best_path`` of a
    ``ModelCheckpoint`` of the same fit that ranks its files (``save_best_only`` or ``save_top_k``).

    The store is embedded by default, so no server is needed: ``tracking_uri=None`` uses
    ``MLFLOW_TRACKING_URI`` if set, else the SQLite file ``mlflow.db`` in the working directory
    (``sqlite:///<cwd>/mlflow.db``, the default of MLflow 3, which refuses the old ``file:``
    store unless told otherwise); ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows
    it. An experiment this callback creates in a local SQLite store keeps its artifacts in
    ``mlruns/`` next to the database file.

    Resume: the run id is part of :meth:`state_dict`, so it travels in checkpoints. A ``fit``
    that resumes from a ``BackupAndRestore`` backup (or ``load_checkpoint``) logs into the same
    run, which goes back to ``RUNNING``; steps the run already holds are not logged twice, so
    one interrupted training is one run with one value per epoch. Under ``torchrun`` only rank
    0 talks to MLflow. If ``fit`` raises, :meth:`close` (which fit calls on its callbacks when it
    fails) marks the run ``FAILED``; a normal end marks it ``FINISHED``.

    A logger never ends a run: when the store cannot be written (a full disk, a deleted folder,
    a server gone) it warns once (a ``FitkitWarning`` naming the store and the fix) and writes
    nothing more in that ``fit``, which goes on; the next ``fit`` tries again. Two runs that
    create a new local SQLite store at once take turns (a lock on its folder), so both log.

    Args:
        tracking_uri: an MLflow tracking URI (``sqlite:///path.db``, ``http://host:5000``,
            ``databricks``, ...); ``None``: see above.
        experiment_name: the experiment of the run, created if missing; ``None``: MLflow's
            ``Default`` experiment.
        run_name: the run's display name; ``None``: MLflow picks one.
        log_every_n_steps: also log the batch logs every that many optimizer steps.
        checkpoint: the file to log as the best checkpoint, or the ``ModelCheckpoint`` whose
            ``best_path`` it is; ``None``: found in the fit's callbacks, if any.
        log_plot: log the learning curves as ``history.png``.
        tags: tags of the run (``{name: value}``).

    Raises:
        ImportError: mlflow is not installed (``pip install ".[mlflow]"`` from a checkout).
        ValueError: a ``log_every_n_steps`` that is not a positive int.
        TypeError: ``checkpoint`` is neither a path nor a ModelCheckpoint.

    Example:
        >>> logger = MLflowLogger("sqlite:///runs/mlflow.db", experiment_name="digits", log_every_n_steps=50)
        >>> logger.tracking_uri, logger.run_id  # the run starts with the first epoch of a fit
        ('sqlite:///runs/mlflow.db', None)

        Then ``model.fit(x, y, callbacks=[logger])``; ``logger.run_id`` names the run, which
        ``mlflow.MlflowClient(logger.tracking_uri).get_run(logger.run_id)`` reads back.
    """

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out

    @declared(_MLFLOW_LOGGER_OPTIONS)
    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        *,
        log_every_n_steps: int | None = None,
        checkpoint: Any = None,
        log_plot: bool = True,
        tags: dict[str, Any] | None = None,
    ):
        super().__init__()
        check_bool("log_plot", log_plot)
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError(
                "MLflowLogger needs mlflow. Install the `mlflow` extra: "
                "`pip install '.[mlflow]'` from a checkout (`pip install 'torch-fitkit[mlflow]'` once released)."
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                "Expected `log_every_n_steps` to be a positive int or None. "
                f"Received: log_every_n_steps={log_every_n_steps!r}."
            )
        if (
            checkpoint is not None
            and not isinstance(checkpoint, (str, os.PathLike))
            and not hasattr(checkpoint, "best_path")
        ):
            raise TypeError(
                f"Expected `checkpoint` to be a path or a ModelCheckpoint. Received: {type(checkpoint).__name__}."
            )
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.log_every_n_steps, self.checkpoint, self.log_plot = log_every_n_steps, checkpoint, bool(log_plot)
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._client: Any = None
        self._active = False  # a run is open: started or reopened by this fit, not yet ended
        self._quiet = False  # a write failed in this fit: nothing more is written until the next
        self._logged_params: set[str] = set()  # params the open run already holds
        self._reset()

    # -- state (saved in checkpoints) --------------------------------------------------------
    def _reset(self) -> None:
        self.run_id: str | None = None
        self._last_epoch, self._last_step = -1, 0  # what the run holds: never logged twice

    def _get_state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")
        self._last_epoch, self._last_step = -1, 0  # read back from the run when it reopens

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files.content import typed_problems

        run_id = (lambda v: v is None or isinstance(v, str), "a run id (str) or None")
        return typed_problems(state, {"run_id": run_id}, "its state", optional=frozenset({"run_id"}))

    # -- the run -----------------------------------------------------------------------------
    def _mlflow_client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        client = self._mlflow_client()
        name = self.experiment_name or "Default"
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        folder = local_sqlite_dir(self.tracking_uri)
        location = None if folder is None else (folder / "mlruns").as_uri()
        return client.create_experiment(name, artifact_location=location)

    def _reopen(self) -> bool:
        """Continue the run of a restored state; False if the store does not hold it."""
        from mlflow.exceptions import MlflowException

        client = self._mlflow_client()
        try:
            run = client.get_run(self.run_id)
        except MlflowException:
            warnings.warn(
                f"MLflowLogger: the run {self.run_id} of the restored state is not in the store "
                f"{self.tracking_uri}; logging to a new run.",
                category=FitkitWarning,
                stacklevel=2,
            )
            return False
        # A crash between this callback's epoch log and the backup leaves steps that the resumed
        # fit replays: skip what the run already holds.
        for key in run.data.metrics:
            steps = [m.step for m in client.get_metric_history(self.run_id, key)]
            if steps and key.startswith(_BATCH_PREFIX):
                self._last_step = max(self._last_step, max(steps))
            elif steps:
                self._last_epoch = max(self._last_epoch, max(steps))
        client.update_run(self.run_id, status="RUNNING")
        self._logged_params = set(run.data.params)
        return True

    def _write(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or ``None`` once a write failed in this fit: a store that cannot be
        written (a full disk, a deleted folder, a server gone) warns once and the logger goes quiet;
        training goes on."""
        if self._quiet:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a logger never ends a run
            self._quiet = True
            warnings.warn(
                f"MLflowLogger stopped writing to {self.tracking_uri} for the rest of this fit, which goes on: "
                f"{what} failed ({type(e).__name__}: {e}). (Fix: free space or fix the store; the next fit "
                "writes again.)",
                category=FitkitWarning,
                stacklevel=3,
            )
            return None

    def _start(self) -> None:
        self._write("starting the run", self._open_run)

    def _open_run(self) -> None:
        self._logged_params = set()
        with store_lock(self.tracking_uri):  # a new SQLite store is created once, not by two runs at once
            if self.run_id is None or not self._reopen():
                run = self._mlflow_client().create_run(self._experiment_id(), run_name=self.run_name, tags=self.tags)
                self.run_id = run.info.run_id
                self._last_epoch, self._last_step = -1, 0
        self._active = True
        # A resumed run keeps the values it started with (MLflow refuses to change a param).
        params = {k: v for k, v in self._fit_params().items() if k not in self._logged_params}
        if params:
            from mlflow.entities import Param

            self._client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def _fit_params(self) -> dict[str, Any]:
        model, params = self.model, self.params
        optimizer = getattr(model, "optimizer", None)
        found: dict[str, Any] = {
            "epochs": params.get("epochs"),
            "batch_size": params.get("batch_size"),
            "steps_per_epoch": params.get("steps"),
            "precision": getattr(model, "precision", None),
            "gradient_accumulation_steps": getattr(model, "gradient_accumulation_steps", None),
        }
        if optimizer is not None:
            found["optimizer"] = type(optimizer).__name__
            found["lr"] = optimizer.param_groups[0].get("lr")
        module = getattr(model, "module", None)
        if module is not None:
            found["module"] = type(module).__name__
            found["num_params"] = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        loss = getattr(model, "loss", None)
        if loss is not None:
            found["loss"] = getattr(loss, "name", None) or type(loss).__name__
        return {k: v for k, v in found.items() if v is not None}

    def _log_metrics(self, logs: Any, step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for key in list(logs):
            value = _number(logs[key])
            if value is not None:
                metrics.append(Metric(prefix + key, value, now, step))
        if metrics:
            self._write("logging metrics", self._client.log_batch, self.run_id, metrics=metrics)

    # -- hooks -------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        folder = local_sqlite_dir(self.tracking_uri or "")
        if folder is not None and is_rank_zero():  # a local store: its folder must be writable
            check_writable(folder, "MLflowLogger", "tracking_uri")
        # The run starts at the first epoch, not here: a resumed fit restores this callback's
        # state (the run id) after on_train_begin.
        self._active = self._quiet = False

    def on_epoch_begin(self, epoch, logs=None):
        if is_rank_zero() and not self._active:
            self._start()

    def on_train_batch_end(self, batch, logs=None):
        if self.log_every_n_steps is None or not self._active or self._quiet:
            return
        step = self.model.global_step
        # With gradient accumulation several batches share a step: the first that reaches it logs.
        if step > self._last_step and step % self.log_every_n_steps == 0:
            self._last_step = step
            self._log_metrics(logs or {}, step, _BATCH_PREFIX)

    def on_validation_end(self, logs=None):
        """Inside-epoch validations: ``step_val_<key>`` with ``step=global_step``."""
        if not self.params.get("validation_interval") or not is_rank_zero() or not logs or self._quiet:
            return
        if not self._active:
            self._start()
        self._log_metrics({k: v for k, v in logs.items() if k.startswith("val_")}, int(logs["step"]), "step_")

    def on_epoch_end(self, epoch, logs=None):
        if not is_rank_zero() or self._quiet:
            return
        if not self._active:
            self._start()
        if epoch > self._last_epoch:
            self._last_epoch = epoch
            self._log_metrics(logs or {}, epoch)

    def on_train_end(self, logs=None):
        if not self._active:
            return
        try:
            self._write("logging the files", self._log_files)
        finally:
            self._end("FINISHED")

    def close(self) -> None:
        """End the run if it is still open (as ``FAILED``: the fit did not reach its end).

        Idempotent: after ``on_train_end`` or a first ``close`` it does nothing.
        """
        if self._active:
            self._end("FAILED")

    def _end(self, status: str) -> None:
        self._active = False
        self._write("ending the run", self._client.set_terminated, self.run_id, status=status)

    # -- artifacts ---------------------------------------------------------------------------
    def _best_checkpoint(self) -> str | None:
        source = self.checkpoint
        if source is None:
            # The fit's callbacks, to find a ModelCheckpoint that ranks its files.
            fit_callbacks = self.model.callbacks
            ranked = [
                cb
                for cb in fit_callbacks
                if type(cb).__name__ == "ModelCheckpoint" and (cb.save_best_only or cb.save_top_k is not None)
            ]
            source = ranked[0] if ranked else None
        if source is None:
            return None
        path = getattr(source, "best_path", source)
        if path is None:
            return None
        owns = getattr(source, "owns", None)
        if callable(owns) and not owns(path):  # a name a crafted or moved checkpoint restored
            warnings.warn(
                f"MLflowLogger: {os.fspath(path)!r} is not a file of the ModelCheckpoint's filepath "
                f"{source.filepath!r}, so it is not uploaded.",
                category=FitkitWarning,
                stacklevel=3,
            )
            return None
        return os.fspath(path)

    def _log_files(self) -> None:
        client = self._client
        best = self._best_checkpoint()
        if best is not None:
            if Path(best).is_file():
                client.log_artifact(self.run_id, best, artifact_path="checkpoints")
            else:
                warnings.warn(
                    f"MLflowLogger: no checkpoint file at {best!r} to log.", category=FitkitWarning, stacklevel=3
                )
        history = getattr(self.model, "history", None)
        if self.log_plot and history is not None and history.history:
            with tempfile.TemporaryDirectory() as folder:
                png = os.path.join(folder, "history.png")
                try:
                    history.plot(path=png)
                except ImportError:
                    warnings.warn(
                        "MLflowLogger: the learning curves need matplotlib (the `plot` extra: "
                        "`pip install '.[plot]'` from a checkout); history.png is not logged.",
                        category=FitkitWarning,
                        stacklevel=3,
                    )
                    return
                client.log_artifact(self.run_id, png)
