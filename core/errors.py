"""Errors the build pipeline raises for bad input.

Each carries a one-line message that names the file, tensor or key at fault; the CLI prints it
and exits non-zero (see runtime/cli.py).
"""


class KdtreeError(Exception):
    """Base class: a user-facing error with a one-line message."""


class ConfigError(KdtreeError):
    """config.json holds a value this stack cannot serve (the message names the key)."""


class CheckpointError(KdtreeError):
    """A checkpoint file is malformed or inconsistent (the message names the file or tensor)."""


class NonFiniteLogits(KdtreeError):
    """A decode step's logits held a NaN or Inf (the message names the round and request); nothing of
    that step was emitted."""
