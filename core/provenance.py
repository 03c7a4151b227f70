"""Where a result came from: the checkout's commit, recorded in every benchmark and bench JSON."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """KDTREE_GIT_COMMIT when set (a copy of the tree whose .git is not the checkout's own: the device tool's copy
    read its HEAD as an earlier session's commit), else the checkout's HEAD (with -dirty when the tree has changes),
    or 'unknown' outside git."""
    if os.environ.get("KDTREE_GIT_COMMIT"):
        return os.environ["KDTREE_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
