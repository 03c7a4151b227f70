"""Where a result came from: the checkout's commit, recorded in every benchmark and bench JSON."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """The checkout's HEAD (with -dirty when the tree has changes), or KDTREE_GIT_COMMIT / 'unknown'
    outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KDTREE_GIT_COMMIT", "unknown")
