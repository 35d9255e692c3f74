"""``WandbLogger``: log a fit to Weights & Biases (``pip install ".[wandb]"`` from a checkout)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.checks import FitkitWarning, check_bool
from fitkit.checks.declared import Option, declare, declared
from fitkit.checks.options import check_tags
from fitkit.distributed.group import is_rank_zero

__all__ = ["WandbLogger"]


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()  # a batch log: one host sync, only when a step is logged
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _numbers(logs: Any, prefix: str) -> dict[str, float]:
    out = {}
    for key in list(logs or {}):
        value = _number(logs[key])
        if value is not None:
            out[prefix + key] = value
    return out


_WANDB_LOGGER_OPTIONS = declare(
    "WandbLogger",
    Option("project", "text", allow_none=True, fix="pass the W&B project's name, e.g. project='digits'."),
    Option("name", "text", allow_none=True, fix="pass the run's display name, e.g. name='baseline'."),
    Option("config", "custom", check=lambda v: check_tags("config", v, "config={'lr': 0.001}"), bad=(["a"], {1: 2})),
    Option("log_every_n_steps", "custom", checked_in="__init__", bad=(0, -1, 1.5, "10", True)),
    Option("log_checkpoints", "bool"),
    Option("checkpoint", "custom", checked_in="WandbLogger.__init__", bad=(5,)),
)


class WandbLogger(Callback):
    """Log a fit to Weights & Biases: its config, per-step and per-epoch logs, validations, the
    learning rate, and the best checkpoint as an artifact when asked.

    The conventions are those of Keras' ``WandbMetricsLogger`` and Lightning's ``WandbLogger``:
    every value is logged with ``step`` the optimizer step (``model.global_step``). After each
    epoch the numeric epoch logs (``loss``, metrics, ``val_*``, ``learning_rate``) are logged as
    ``epoch/<key>`` with ``epoch/epoch`` (0-based); with ``log_every_n_steps`` the running means of
    the batch logs are logged every that many optimizer steps as ``batch/<key>`` with
    ``batch/learning_rate`` (the first param group's); each validation inside an epoch
    (``fit(validation_interval=...)``) is logged as ``step/val_<key>`` at its own ``step``. The
    run's config holds what ``compile`` and ``fit`` set (``optimizer``, ``lr``, ``batch_size``,
    ``epochs``, ``steps_per_epoch``, ``max_steps``, ``precision``, ``gradient_accumulation_steps``,
    ``module``, ``num_params``, ``loss``) and ``config``. With ``log_checkpoints=True`` the
    best checkpoint (``checkpoint``, or the ``best_path`` of a ``ModelCheckpoint`` of the fit that
    ranks its files) is logged at the end as a ``model`` artifact.

    A run open when ``fit`` starts (``wandb.run``, from the user's own ``wandb.init``) is logged
    into and left open; else the logger starts one with ``wandb.init(**init_kwargs)`` and
    finishes it at the end of the fit (exit code 1 when the fit fails). ``WANDB_MODE=offline``
    writes the run under ``WANDB_DIR`` with no network; ``wandb sync`` uploads it later. Under
    ``torchrun`` only rank 0 talks to W&B. A logger never stops training: an error of W&B is
    turned into one ``FitkitWarning`` and the logger goes quiet for the rest of the fit.

    Args:
        project: the W&B project (``wandb.init``'s ``project``).
        name: the run's display name.
        config: more entries for the run's config.
        log_every_n_steps: also log the batch logs every that many optimizer steps.
        log_checkpoints: log the best checkpoint as an artifact at the end of the fit.
        checkpoint: the file to log, or the ``ModelCheckpoint`` whose ``best_path`` it is.
        **init_kwargs: passed on to ``wandb.init`` (``dir``, ``mode``, ``tags``, ``group``, ...).

    Raises:
        ImportError: wandb is not installed (``pip install ".[wandb]"`` from a checkout).
        ValueError: a ``log_every_n_steps`` that is not a positive int.
        TypeError: ``checkpoint`` is neither a path nor a ModelCheckpoint.

    Example:
        >>> logger = WandbLogger(project="digits", log_every_n_steps=50, mode="offline")
        >>> logger.run is None  # the run starts with the fit
        True
    """

    @declared(_WANDB_LOGGER_OPTIONS)
    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        *,
        config: dict[str, Any] | None = None,
        log_every_n_steps: int | None = None,
        log_checkpoints: bool = False,
        checkpoint: Any = None,
        **init_kwargs: Any,
    ):
        super().__init__()
        check_bool("log_checkpoints", log_checkpoints)
        if importlib.util.find_spec("wandb") is None:
            raise ImportError(
                "WandbLogger needs wandb. Install the `wandb` extra: "
                "`pip install '.[wandb]'` from a checkout (`pip install 'torch-fitkit[wandb]'` once released)."
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                "Expected `log_every_n_steps` to be a positive int or None. "
                f"Received: log_every_n_steps={log_every_n_steps!r}. Fix: pass e.g. 50."
            )
        if (
            checkpoint is not None
            and not isinstance(checkpoint, (str, os.PathLike))
            and not hasattr(checkpoint, "best_path")
        ):
            raise TypeError(
                "Expected `checkpoint` to be a path or a ModelCheckpoint. "
                f"Received: {type(checkpoint).__name__}. Fix: pass the file's path or the callback."
            )
        self.project, self.name, self.config = project, name, dict(config or {})
        self.log_every_n_steps, self.checkpoint = log_every_n_steps, checkpoint
        self.log_checkpoints = bool(log_checkpoints)
        self.init_kwargs = init_kwargs
        self.run: Any = None  # the wandb Run of the fit (rank 0), or None
        self._owns_run = False
        self._quiet = False  # a W&B call failed: nothing more is logged in this fit
        self._last_step = -1

    # -- W&B calls: a failure warns once and the logger goes quiet ---------------------------
    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a logger never stops training
            if not self._quiet:
                warnings.warn(
                    f"WandbLogger: {what} failed ({type(e).__name__}: {e}); W&B logging stops for this "
                    "fit, training goes on.",
                    category=FitkitWarning,
                    stacklevel=3,
                )
            self._quiet = True
            return None

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is not None and data and not self._quiet:
            self._guard("wandb.log", self.run.log, data, step=step)

    def _fit_config(self) -> dict[str, Any]:
        model, params = self.model, self.params
        optimizer = getattr(model, "optimizer", None)
        found: dict[str, Any] = {
            "epochs": params.get("epochs"),
            "batch_size": params.get("batch_size"),
            "steps_per_epoch": params.get("steps"),
            "max_steps": params.get("max_steps"),
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
        return {**{k: v for k, v in found.items() if v is not None}, **self.config}

    # -- hooks -------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self.run, self._owns_run, self._last_step, self._quiet = None, False, -1, False
        if not is_rank_zero():
            return
        import wandb

        if wandb.run is not None:
            self.run = wandb.run
            self._guard("config.update", self.run.config.update, self._fit_config(), allow_val_change=True)
            return
        kwargs = {"project": self.project, "name": self.name, **self.init_kwargs}
        self.run = self._guard("wandb.init", wandb.init, config=self._fit_config(), **kwargs)
        self._owns_run = self.run is not None

    def on_train_batch_end(self, batch, logs=None):
        if self.log_every_n_steps is None or self.run is None or self._quiet:
            return
        step = self.model.global_step
        # With gradient accumulation several batches share a step: the first that reaches it logs.
        if step > self._last_step and step % self.log_every_n_steps == 0:
            self._last_step = step
            data = _numbers(logs, "batch/")
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                data["batch/learning_rate"] = float(optimizer.param_groups[0]["lr"])
            self._log(data, step)

    def on_validation_end(self, logs=None):
        if self.run is None or not self.params.get("validation_interval") or not logs:
            return
        self._log(_numbers({k: v for k, v in logs.items() if k.startswith("val_")}, "step/"), int(logs["step"]))

    def on_epoch_end(self, epoch, logs=None):
        if self.run is None:
            return
        self._log({**_numbers(logs, "epoch/"), "epoch/epoch": epoch}, self.model.global_step)
        self._check_disk()

    def _check_disk(self) -> None:
        """W&B writes the run's file from its own service process, so a full disk raises nothing
        here: the free space of the run's folder is read once per epoch (one ``statvfs``), and a
        full disk warns once, as the other loggers do, naming the folder."""
        files = getattr(self.run, "dir", None)
        if self._quiet or not isinstance(files, str):
            return
        folder = os.path.dirname(files)  # the run's folder, holding its .wandb file
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return
        if free == 0:
            self._quiet = True
            warnings.warn(
                f"WandbLogger: the disk holding the run's folder {folder!r} is full (0 bytes free), so W&B "
                "cannot write the run's file; W&B logging stops for this fit, training goes on. Fix: free "
                "space, or pass dir= on another disk.",
                category=FitkitWarning,
                stacklevel=3,
            )

    def on_train_end(self, logs=None):
        if self.run is None:
            return
        if self.log_checkpoints and not self._quiet:
            self._log_checkpoint()
        self._finish(0)

    def close(self) -> None:
        """Finish a run this logger started that is still open (exit code 1: the fit failed)."""
        self._finish(1)

    def _finish(self, exit_code: int) -> None:
        run, owned = self.run, self._owns_run
        self.run, self._owns_run = None, False
        if run is not None and owned:
            self._guard("wandb.finish", run.finish, exit_code=exit_code)

    def _best_checkpoint(self) -> str | None:
        source = self.checkpoint
        if source is None:
            ranked = [
                cb
                for cb in self.model.callbacks
                if type(cb).__name__ == "ModelCheckpoint" and (cb.save_best_only or cb.save_top_k is not None)
            ]
            source = ranked[0] if ranked else None
        path = None if source is None else getattr(source, "best_path", source)
        return None if path is None else os.fspath(path)

    def _log_checkpoint(self) -> None:
        best = self._best_checkpoint()
        if best is None or not Path(best).is_file():
            warnings.warn(
                f"WandbLogger: log_checkpoints=True, but there is no checkpoint file to log ({best!r}).",
                category=FitkitWarning,
                stacklevel=3,
            )
            return
        import wandb

        run = self.run

        def log() -> None:
            artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={"global_step": self.model.global_step})
            artifact.add_file(best)
            run.log_artifact(artifact, aliases=["best", "latest"])

        self._guard("log_artifact", log)
