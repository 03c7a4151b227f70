"""Writing an output folder atomically: build it in a stage folder beside it, then rename it into place."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty stage folder beside `out`; on success it replaces `out`, on error it is removed (so
    `out` is either the old folder, untouched, or the whole new one)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield stage
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
