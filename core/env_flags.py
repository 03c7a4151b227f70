"""On/off switches read from the environment (KDTREE_PDL, KDTREE_FUSION, KDTREE_MOE_PREFETCH, ...)."""

from __future__ import annotations

import os


def env_flag(name: str, default: bool) -> bool:
    """Unset or empty: default; "1": on; "0": off.  Anything else is a ValueError naming the variable, so that a
    typo ("off", "true") does not leave a switch silently as it was."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")
