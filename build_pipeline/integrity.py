"""Is an artifact's file the one its manifest lists?  Checked on every load and on every cache hit.

The manifest records each file's sha256 and size.  A reader checks the size of every file it opens
(free), and the sha256 of every file not yet proven intact: hashed in worker threads while the
caller reads the same file (hashlib and file reads release the GIL, so the hash overlaps the copy
to the device; both read the page cache, the disk is read once).  A file whose hash matched is
marked in ART/.verified/<relative path> with its (size, mtime_ns, ctime_ns, inode) taken before
hashing; a later reader skips the hash while all four are unchanged.  Any write to the file (one
flipped byte included) moves its ctime, which no user call can set back, so a marked file that was
written since is hashed again; what the mark does not see is damage below the file system (bit rot,
a faulty disk): delete ART/.verified to re-hash everything.  Marks are best effort: an artifact on a
read-only file system is simply hashed on every load.

Measured (CPU machine, 2 cores, page cache warm; benchmarks/integrity_load.py, the README table):
sha256 runs at ~1.5 GB/s per core here, so a first load pays about size / (1.5 GB/s x threads) on
top of the copy, later loads only a stat per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from core.errors import CheckpointError

VERIFIED = ".verified"  # ART/.verified/<relative path>: [size, mtime_ns, ctime_ns, inode, sha256] of a checked file
_CHUNK = 1 << 22  # 4 MiB reads when hashing


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def member(art_dir: Path, rel: str) -> Path:
    """art_dir / rel, refusing a manifest path that leaves the artifact (absolute, `..`, a symlink out)."""
    p = art_dir / rel
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts \
            or not p.resolve().is_relative_to(art_dir.resolve()):
        raise CheckpointError(f"{art_dir / 'manifest.json'}: lists the file {rel!r}, outside the artifact; "
                              f"refusing to open it")
    return p


def _stamp(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class FileCheck:
    """Checks files of one artifact against their manifest entries ({sha256, bytes}) in `workers` threads.

    submit(rel, info) checks the size at once and starts the hash unless the file is marked; wait()
    raises CheckpointError for the first mismatch (in submit order) and marks the files that matched."""

    def __init__(self, art_dir: str | Path, workers: int = 2):
        self.art_dir = Path(art_dir)
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kdtree-sha256")
        self.pending: list[tuple[str, Path, dict, list[int], Future]] = []
        self.hashed = 0  # files hashed (not skipped through a mark), for tests and the cost table

    def submit(self, rel: str, info: dict) -> Path:
        """Start checking art_dir/rel; returns its path (sandboxed to the artifact)."""
        p = member(self.art_dir, rel)
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the artifact's manifest lists it)")
        stamp = _stamp(p)
        if stamp[0] != info["bytes"]:
            raise CheckpointError(f"{p}: {stamp[0]} bytes, the manifest says {info['bytes']} (truncated or "
                                  f"modified; rebuild with `kdtree build --force`)")
        if self._marked(rel) != stamp + [info["sha256"]]:
            self.pending.append((rel, p, info, stamp, self.pool.submit(sha256_file, p)))
            self.hashed += 1
        return p

    def close(self) -> None:
        """Stop without checking (the caller failed first)."""
        self.pending.clear()
        self.pool.shutdown(cancel_futures=True)

    def wait(self) -> None:
        try:
            for rel, p, info, stamp, fut in self.pending:
                if fut.result() != info["sha256"]:
                    raise CheckpointError(f"{p}: sha256 differs from the manifest's (the file is corrupted or was "
                                          f"modified; rebuild with `kdtree build --force`)")
                self._mark(rel, stamp + [info["sha256"]])
        finally:
            self.close()

    def _marked(self, rel: str) -> list | None:
        try:
            return json.loads((self.art_dir / VERIFIED / rel).read_text())
        except (OSError, ValueError):
            return None

    def _mark(self, rel: str, mark: list) -> None:
        path = self.art_dir / VERIFIED / rel
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(mark))
            os.replace(tmp, path)
        except OSError:  # read-only artifact: hashed again next time
            tmp.unlink(missing_ok=True)


def check_files(art_dir: str | Path, files: dict[str, dict], workers: int = 2) -> None:
    """Check every listed file ({relative path: {sha256, bytes}}) now; CheckpointError on the first bad one."""
    check = FileCheck(art_dir, workers)
    try:
        for rel, info in files.items():
            check.submit(rel, info)
    except BaseException:
        check.close()
        raise
    check.wait()
