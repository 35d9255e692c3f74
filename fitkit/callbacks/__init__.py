"""Callbacks: the hook protocol, History, the progress bar and the stock callbacks.

- :mod:`~fitkit.callbacks.base`: ``Callback``, ``CallbackList``, ``History``, ``BatchLogs``.
- :mod:`~fitkit.callbacks.monitor`: ``EarlyStopping`` and the shared monitor / mode logic.
- :mod:`~fitkit.callbacks.logkeys`: which log keys a callback can read, checked before step 1.
- :mod:`~fitkit.callbacks.lr`: ``LearningRateScheduler``, ``ReduceLROnPlateau``.
- :mod:`~fitkit.callbacks.checkpointing`: ``ModelCheckpoint``.
- :mod:`~fitkit.callbacks.backup`: ``BackupAndRestore``.
- :mod:`~fitkit.callbacks.logging`: ``CSVLogger``, ``TensorBoard``.
- :mod:`~fitkit.callbacks.misc`: ``TerminateOnNaN``, ``LambdaCallback``.
- :mod:`~fitkit.callbacks.averaging`: ``EMA``, ``SWA`` (weight averaging).
- :mod:`~fitkit.callbacks.mlflow`: ``MLflowLogger`` (``pip install fitkit[mlflow]``).
- :mod:`~fitkit.callbacks.optuna`: ``OptunaPruning`` (``pip install fitkit[optuna]``).

The MLflow and Optuna callbacks import their library when they are created, not here.
"""

from fitkit.callbacks.accumulation import GradientAccumulationScheduler
from fitkit.callbacks.averaging import EMA, SWA
from fitkit.callbacks.backup import BackupAndRestore
from fitkit.callbacks.base import BatchLogs, Callback, CallbackList, History
from fitkit.callbacks.checkpointing import ModelCheckpoint
from fitkit.callbacks.logging import CSVLogger, TensorBoard
from fitkit.callbacks.lr import LearningRateScheduler, ReduceLROnPlateau
from fitkit.callbacks.misc import LambdaCallback, TerminateOnNaN
from fitkit.callbacks.mlflow import MLflowLogger
from fitkit.callbacks.monitor import EarlyStopping
from fitkit.callbacks.optuna import OptunaPruning
from fitkit.callbacks.progress import ProgressBar

__all__ = [
    "GradientAccumulationScheduler",
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
    "EMA",
    "SWA",
    "MLflowLogger",
    "OptunaPruning",
]
