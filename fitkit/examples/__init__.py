"""Runnable examples: ``python -m fitkit.examples.digits`` and ``python -m fitkit.examples.shakespeare``."""
