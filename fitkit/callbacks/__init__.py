"""Callbacks: the hook protocol, History, the progress bar and the stock callbacks.

- :mod:`~fitkit.callbacks.base`: ``Callback``, ``CallbackList``, ``History``, ``BatchLogs``.
- :mod:`~fitkit.callbacks.monitor`: ``EarlyStopping`` and the shared monitor / mode logic.
- :mod:`~fitkit.callbacks.logkeys`: which log keys a callback can read, checked before step 1.
- :mod:`~fitkit.callbacks.lr`: ``LearningRateScheduler``, ``ReduceLROnPlateau``, ``LearningRateFinder``.
- :mod:`~fitkit.callbacks.checkpointing`: ``ModelCheckpoint``.
- :mod:`~fitkit.callbacks.backup`: ``BackupAndRestore``.
- :mod:`~fitkit.callbacks.logging`: ``CSVLogger``; :mod:`~fitkit.callbacks.tensorboard`: ``TensorBoard``.
- :mod:`~fitkit.callbacks.misc`: ``TerminateOnNaN``, ``LambdaCallback``.
- :mod:`~fitkit.callbacks.averaging`: ``EMA``, ``SWA`` (weight averaging, on
  :mod:`~fitkit.callbacks.weight_averaging`'s ``WeightAveraging``; :mod:`~fitkit.callbacks.scoring`:
  which weights a value scored; :mod:`~fitkit.callbacks.swapping`: one swap of the weights at a
  time); :mod:`~fitkit.callbacks.swap_ema`: Keras' ``SwapEMAWeights`` and ``compile(use_ema=True)``.
- :mod:`~fitkit.callbacks.throughput`: ``ThroughputMonitor`` (samples / tokens per second, FLOPs, MFU).
- :mod:`~fitkit.callbacks.optim_monitor`: ``OptimizerMonitor`` (gradient and update norms),
  ``LearningRateMonitor`` (momentum, betas and weight decay beside the learning rate).
- :mod:`~fitkit.callbacks.profiler`: ``Profiler`` (``torch.profiler`` over a schedule of steps).
- :mod:`~fitkit.callbacks.mlflow`: ``MLflowLogger`` (``pip install ".[mlflow]"`` from a checkout).
- :mod:`~fitkit.callbacks.optuna`: ``OptunaPruning`` (``pip install ".[optuna]"`` from a checkout).
- :mod:`~fitkit.callbacks.timer`: ``Timer`` (a time budget, Lightning's ``max_time``).
- :mod:`~fitkit.callbacks.tokens`: ``TokensSeen`` (``num_input_tokens_seen`` in logs and checkpoints).
- :mod:`~fitkit.callbacks.neftune`: ``NEFTune`` (noisy input embeddings while fine-tuning).
- :mod:`~fitkit.callbacks.wandb`: ``WandbLogger`` (``pip install ".[wandb]"`` from a checkout).
- :mod:`~fitkit.callbacks.raytrain`: ``RayReport`` (Ray Train's reports, checkpoints and restarts;
  ``pip install ".[ray]"`` from a checkout).

The MLflow, Optuna, W&B and Ray callbacks import their library when they are created, not here.
"""

from fitkit.callbacks.accumulation import AccumulationSchedule, GradientAccumulationScheduler
from fitkit.callbacks.averaging import EMA, SWA, WeightAveraging
from fitkit.callbacks.backup import BackupAndRestore
from fitkit.callbacks.base import BatchLogs, Callback, CallbackList, History
from fitkit.callbacks.checkpointing import ModelCheckpoint
from fitkit.callbacks.logging import CSVLogger
from fitkit.callbacks.lr import LearningRateFinder, LearningRateScheduler, ReduceLROnPlateau
from fitkit.callbacks.misc import LambdaCallback, TerminateOnNaN
from fitkit.callbacks.mlflow import MLflowLogger
from fitkit.callbacks.monitor import EarlyStopping
from fitkit.callbacks.neftune import NEFTune
from fitkit.callbacks.optim_monitor import LearningRateMonitor, OptimizerMonitor
from fitkit.callbacks.optuna import OptunaPruning
from fitkit.callbacks.profiler import Profiler
from fitkit.callbacks.progress import ProgressBar
from fitkit.callbacks.raytrain import RayReport
from fitkit.callbacks.swap_ema import SwapEMAWeights
from fitkit.callbacks.tensorboard import TensorBoard
from fitkit.callbacks.throughput import ThroughputMonitor
from fitkit.callbacks.timer import Timer
from fitkit.callbacks.tokens import TokensSeen
from fitkit.callbacks.wandb import WandbLogger

__all__ = [
    "RayReport",
    "WandbLogger",
    "NEFTune",
    "TokensSeen",
    "Timer",
    "GradientAccumulationScheduler",
    "AccumulationSchedule",
    "Callback",
    "CallbackList",
    "History",
    "BatchLogs",
    "ProgressBar",
    "EarlyStopping",
    "ReduceLROnPlateau",
    "ModelCheckpoint",
    "BackupAndRestore",
    "CSVLogger",
    "TensorBoard",
    "TerminateOnNaN",
    "LambdaCallback",
    "LearningRateScheduler",
    "LearningRateFinder",
    "EMA",
    "SWA",
    "SwapEMAWeights",
    "WeightAveraging",
    "MLflowLogger",
    "OptunaPruning",
    "ThroughputMonitor",
    "Profiler",
    "OptimizerMonitor",
    "LearningRateMonitor",
]
