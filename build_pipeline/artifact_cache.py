"""Content-addressed artifact cache: one folder per build key under KDTREE_CACHE.

Layout: `$KDTREE_CACHE/<key>/` holds manifest.json plus everything it lists (rank{r}/, kernels/,
graphs/, drafter/, tokenizer/).  An entry counts as complete only when `<key>/manifest.json`
exists, and `<key>/` only appears by one `os.rename` of a fully written staging folder
(`.stage-<key>-<pid>-<rand>/`), so an interrupted build leaves nothing that looks complete.
`<key>/autotune/` is not listed in the manifest: the runtime stores there the cost curves it
measures on first use of `--budget auto` (runtime/decode/budget.py), one folder per GPU, dtype,
batch and largest budget.

Key = sha256 of canonical JSON over the input files' sha256 (config, safetensors shards, tokenizer,
drafter), the build options, the code version (sha256 of core/, build_pipeline/ and plugins/ sources) and
the toolchain versions.  Input hashes are memoised by (path, size, mtime_ns, inode) in
`.hashes.json`, so a second build of a 600 GB checkpoint does not re-read it.  On a hit every file
of the entry is checked against the manifest's sha256 list (build_pipeline/integrity.py: re-hashed
unless marked intact and unchanged since); a mismatch means a rebuild.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from build_pipeline.integrity import check_files, sha256_file
from core.errors import CheckpointError

log = logging.getLogger("kdtree.cache")

MANIFEST = "manifest.json"
FORMAT = "kdtree-artifact"  # manifest["format"] of a built artifact
FORMAT_VERSION = 1
_REPO = Path(__file__).resolve().parent.parent
_CODE_DIRS = ("core", "build_pipeline", "plugins")
_CODE_SUFFIXES = (".py", ".cu", ".cuh", ".h")


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class HashMemo:
    """sha256 of input files, remembered by (size, mtime_ns, inode) so unchanged files are not re-read."""

    def __init__(self, root: Path):
        self.path = root / ".hashes.json"
        try:
            self.table: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.table = {}
        self.dirty = False

    def sha256(self, path: Path) -> str:
        path = path.resolve()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.table.get(str(path))
        if hit is not None and hit[:3] == stamp:
            return hit[3]
        digest = sha256_file(path)
        self.table[str(path)] = stamp + [digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".hashes.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(self.table))
        os.replace(tmp, self.path)
        self.dirty = False


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 over the relative paths and bytes of the build's sources (core/, build_pipeline/, plugins/),
    taken once per process: the code a process runs is the code it imported at start."""
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for p in sorted((_REPO / d).rglob("*")):
            if p.is_file() and p.suffix in _CODE_SUFFIXES and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(_REPO)).encode() + b"\0")
                h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def nvcc_version() -> str | None:
    """Last line of `nvcc --version` (e.g. 'Build cuda_13.0.r13.0/compiler.36424714_0'), None if absent."""
    exe = shutil.which("nvcc")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str | None]:
    """Versions of everything whose output lands in an artifact (package metadata: nothing is imported)."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": version("torch"), "triton": version("triton"),
            "onnx": version("onnx"), "safetensors": version("safetensors"), "nvcc": nvcc_version(),
            "format": str(FORMAT_VERSION)}


def build_key(inputs: dict[str, str], options: dict, code: str, tools: dict) -> str:
    """The entry name: sha256 (first 40 hex) of everything that decides the artifact's bytes."""
    return sha256_json({"inputs": inputs, "options": options, "code": code, "toolchain": tools})[:40]


def hash_tree(folder: Path) -> dict[str, dict]:
    """{relative posix path: {sha256, bytes}} of every file under folder except the manifest."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def verify(entry: Path) -> str | None:
    """None if entry is complete and every listed file matches its sha256 (build_pipeline/integrity.py:
    files hashed before and unchanged since are not re-read), else why not."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        check_files(entry, files, workers=os.cpu_count() or 1)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{entry / MANIFEST}: unreadable ({exc.__class__.__name__})"
    except CheckpointError as exc:
        return str(exc)
    return None


def lookup(root: Path, key: str, check: bool = True) -> Path | None:
    """The complete entry for key, or None (absent, or failing verification: logged, caller rebuilds)."""
    entry = root / key
    if not (entry / MANIFEST).is_file():
        return None
    if check:
        why = verify(entry)
        if why is not None:
            log.warning("cache entry %s rejected: %s; rebuilding", key, why)
            return None
    return entry


@contextmanager
def staging(root: Path, key: str) -> Iterator[Path]:
    """A fresh private folder to build into; removed if the block raises (Ctrl-C included)."""
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale(root)
    stage = root / f".stage-{key}-{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def commit(stage: Path, root: Path, key: str, manifest: dict) -> Path:
    """Write manifest.json (last) into stage, then rename stage -> root/key, replacing a bad old entry.

    A valid entry already there is a concurrent builder's (same key: the same bytes), which another process may
    be reading: it stays, and this stage is dropped.  Only a rejected (corrupted or incomplete) entry is moved
    aside; if another builder renames its stage into place first, its entry is the one returned."""
    tmp = stage / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, stage / MANIFEST)
    entry = root / key
    if _complete(entry):
        shutil.rmtree(stage, ignore_errors=True)
        return entry
    if entry.exists():  # a rejected entry: move it aside first
        trash = root / f".trash-{key}-{secrets.token_hex(4)}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:  # another builder moved it first
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(stage, entry)
    except OSError:  # another builder's stage took the name between the check and the rename
        if not _complete(entry):
            raise
        shutil.rmtree(stage, ignore_errors=True)
    return entry


def _complete(entry: Path) -> bool:
    """entry has its manifest and every file it lists, intact."""
    return (entry / MANIFEST).is_file() and verify(entry) is None


def _sweep_stale(root: Path) -> None:
    """Remove staging folders of builders that no longer run, and leftover trash."""
    for p in root.glob(".stage-*"):
        try:
            pid = int(p.name.split("-")[2])
            os.kill(pid, 0)
            continue  # its builder is alive
        except (ValueError, IndexError):
            pass
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".trash-*"):
        shutil.rmtree(p, ignore_errors=True)
