"""fitkit: Keras-style ``compile`` / ``fit`` / ``evaluate`` / ``predict`` for any PyTorch module.

Example:
    >>> import torch, fitkit
    >>> model = fitkit.Model(torch.nn.Linear(3, 2), device="cpu")
    >>> model.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"])
    >>> sorted(model.evaluate(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), verbose=0))
    ['accuracy', 'loss']
"""

__version__ = "0.1.0"

from fitkit import callbacks, data, layers
from fitkit.callbacks import Callback, History
from fitkit.checks import FitkitWarning
from fitkit.checks.namesake import warn_about_namesakes
from fitkit.model import Model

# An unrelated distribution named `fitkit` installs the same import package: say so once, with the fix.
warn_about_namesakes()

__all__ = ["Model", "Callback", "History", "FitkitWarning", "callbacks", "data", "layers", "__version__"]
