"""At load on CUDA: the artifact's Triton kernels into the user's Triton cache, or one clear message.

`kdtree build` on a GPU ships the Triton cache of a warm-up decode in ART/kernels/triton-<arch>/
(build_pipeline/kernel_cache.py says what and how).  When the manifest's triton_cache was made for this
GPU's arch with this process's Triton version, its files are checked against the manifest's sha256
(build_pipeline/integrity.py) and the entries the user's cache (triton.knobs.cache.dir: TRITON_CACHE_DIR,
else ~/.triton/cache) lacks are copied there, so Triton finds every variant the warm-up compiled and compiles
none.  The artifact is only read.  Otherwise a KernelCacheWarning says why, and Triton compiles at first use
as it would without an artifact cache.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from build_pipeline.integrity import check_files, member
from build_pipeline.kernel_cache import unpack
from core.errors import CheckpointError
from plugins.common.cubin import PLUGINS, register_cubin, source_sha256
from plugins.common.device import device_facts


class KernelCacheWarning(UserWarning):
    """The artifact has no Triton kernels usable here: they compile at first use (JIT)."""


def why_not(record: dict | None, arch: str, triton_version: str, manifest_path: Path) -> str | None:
    """None when the manifest's triton_cache record serves a GPU of `arch` under `triton_version`, else why
    not (one line naming the manifest).  A malformed record is a CheckpointError naming the key."""
    if record is None:
        return f"{manifest_path}: no triton_cache record (built before kernel caches were shipped)"
    if not isinstance(record, dict) or not isinstance(record.get("warmed"), bool):
        raise CheckpointError(f"{manifest_path}: triton_cache must be an object with a boolean \"warmed\", "
                              f"got {record!r}")
    if not record["warmed"]:
        return f"{manifest_path}: triton_cache not warmed ({record.get('reason', 'no reason given')})"
    for key in ("dir", "arch", "triton"):
        if not isinstance(record.get(key), str):
            raise CheckpointError(f"{manifest_path}: triton_cache.{key} must be a string, got {record.get(key)!r}")
    if record["arch"] != arch or record["triton"] != triton_version:
        return (f"{manifest_path}: triton_cache holds kernels for {record['arch']} with Triton {record['triton']}; "
                f"this GPU is {arch} with Triton {triton_version}")
    return None


def install(art_dir: str | Path, manifest: dict, arch: str, triton_version: str, triton_dir: str | Path) -> dict | None:
    """Copy the artifact's kernel cache into triton_dir when it serves (arch, triton_version); returns
    kernel_cache.unpack's {entries, copied}, or None after a KernelCacheWarning (the JIT path)."""
    art_dir = Path(art_dir)
    record = manifest.get("triton_cache")
    why = why_not(record, arch, triton_version, art_dir / "manifest.json")
    if why is not None:
        warnings.warn(f"{why}: Triton kernels compile at first use", KernelCacheWarning, stacklevel=2)
        return None
    prefix = record["dir"].rstrip("/") + "/"
    src = member(art_dir, record["dir"])
    listed = {rel: info for rel, info in manifest.get("files", {}).items() if rel.startswith(prefix)}
    if not listed or not src.is_dir():
        raise CheckpointError(f"{art_dir / 'manifest.json'}: triton_cache.dir {record['dir']!r} lists no files "
                              f"in the artifact (rebuild with `kdtree build --force`)")
    on_disk = {p.relative_to(art_dir).as_posix() for p in src.rglob("*") if p.is_file()}
    extra = sorted(on_disk - set(listed))
    if extra:  # copied into a cache Triton trusts: nothing the manifest does not vouch for
        raise CheckpointError(f"{art_dir / extra[0]}: not listed in the manifest (rebuild with `kdtree build "
                              f"--force`)")
    check_files(art_dir, listed)
    return unpack(src, Path(triton_dir))


def register_cuda_kernels(art_dir: str | Path, manifest: dict) -> list[str]:
    """The artifact's compiled CUDA C kernels (manifest "kernels" of kind "cuda": kernels/<arch>/<op>/<stem>.cubin,
    checked against the manifest's sha256) made the first place plugins/common/cubin.py looks, so ops called
    inside the model (moe_w4a16 v3) and the budget-auto setter load them instead of compiling; returns the cubins
    registered (none: the runtime compiles at first use, as without an artifact).  Only cubins built from the
    sources this runtime runs (the record's source_sha256 against plugins/<op>/<name>.cu) are registered: one of
    another version (or recorded without one) may take other arguments, so it is left out with a KernelCacheWarning
    and its source compiles at first use."""
    art_dir = Path(art_dir)
    records = [k for k in manifest.get("kernels", []) if isinstance(k, dict) and k.get("kind") == "cuda"
               and isinstance(k.get("cubin"), str)]
    files = manifest.get("files", {})
    listed = {k["cubin"]: files[k["cubin"]] for k in records if k["cubin"] in files}
    if not listed:
        return []
    check_files(art_dir, listed)  # also refuses a path out of the artifact
    registered, stale = [], []
    for k in records:
        rel = k["cubin"]
        if rel not in listed:
            continue
        source = PLUGINS / str(k.get("op", "")) / f"{k.get('name', '')}.cu"
        if not (source.is_file() and source.resolve().is_relative_to(PLUGINS)
                and k.get("source_sha256") == source_sha256(source)):
            stale.append(rel)
            continue
        register_cubin(art_dir / rel, str(k.get("arch")), source.parent.name, source.stem)
        registered.append(rel)
    if stale:
        warnings.warn(KernelCacheWarning(
            f"{art_dir / stale[0]}" + (f" and {len(stale) - 1} more" if len(stale) > 1 else "")
            + ": built from another version of its plugins/ source (or before builds recorded it): compiled from "
            "the current source at first use instead (rebuild with `kdtree build --force`)"), stacklevel=2)
    return sorted(registered)


def install_for_device(art_dir: str | Path, manifest: dict, device) -> dict | None:
    """install() for a CUDA device with this process's Triton and its cache dir; None off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    import triton

    arch = device_facts(device).arch
    return install(art_dir, manifest, arch, triton.__version__, triton.knobs.cache.dir)
