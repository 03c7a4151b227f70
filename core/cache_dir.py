"""Where kdtree keeps what it builds or compiles on this machine (artifacts, cubins)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """KDTREE_CACHE, else $XDG_CACHE_HOME/kdtree, else ~/.cache/kdtree."""
    env = os.environ.get("KDTREE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kdtree"
