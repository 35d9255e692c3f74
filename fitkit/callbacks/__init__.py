"""Callbacks: the hook protocol, History, the progress bar and the stock callbacks."""

from fitkit.callbacks.base import BatchLogs, Callback, CallbackList, History
from fitkit.callbacks.progress import ProgressBar

__all__ = ["Callback", "CallbackList", "History", "BatchLogs", "ProgressBar"]
