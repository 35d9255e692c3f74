"""The machinery of one ``fit`` / ``evaluate`` / ``predict`` call.

:mod:`fitkit.training.state` is the registry of a run's stateful parts (what a checkpoint
holds, checks and restores, and when each part takes its state).
"""
