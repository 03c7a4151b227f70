"""A plugin's CUDA C kernels as a cubin for one GPU arch, without compiling at run where the artifact has them.

Found in order:
  1. an artifact's kernels/<arch>/<op>/<stem>.cubin (`kdtree build` compiles plugins/**/*.cu with nvcc,
     build_pipeline/compile_kernels.py, recording each source's source_sha256); the runtime registers a loaded
     artifact's cubins built from the sources it runs (register_cubin; runtime/load/kernel_cache.py) so ops called
     deep inside a model find them, and never one of another source version, whose kernels may take other arguments;
  2. the kdtree cache: <cache>/kernels/<arch>/<stem>-<source sha>.cubin;
  3. compiled now by NVRTC (cuda.bindings.nvrtc), else nvcc, and stored in the cache (once per machine and
     source).  A source's `#include "..."` of a header under plugins/ (plugins/common/cuda/*.cuh) is inlined first
     (source_text: what is hashed and compiled), so NVRTC needs no include path.

CubinUnavailable names what is missing when none of them gives one.

A source that uses an arch's feature set (sm_90a's wgmma) says so with the line `#define KDTREE_ARCH_FEATURES`; its
cubin for "sm_90" is then compiled for "sm_90a" (compile_arch), which runs on the same GPUs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent  # the folder whose headers a source may include
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.MULTILINE)
_BUILT: dict[tuple[str, str, str], Path] = {}  # (arch, op, stem) -> an artifact's cubin of the current source
COMPILED: list[str] = []  # "<source> for <arch>" of each cubin this process compiled (tests assert none)


FEATURES_MARKER = b"#define KDTREE_ARCH_FEATURES"
FEATURE_ARCHS = ("sm_90",)  # archs with an "a" feature set (sm_90a: wgmma, setmaxnreg)


def compile_arch(text: bytes, arch: str) -> str:
    """The arch a source compiles for: arch + "a" where the source asks for the feature set and arch has one."""
    return arch + "a" if arch in FEATURE_ARCHS and FEATURES_MARKER in text else arch


class CubinUnavailable(RuntimeError):
    """No cubin of a kernel source for this arch could be found or compiled."""


def source_text(source: Path, _seen: set[Path] | None = None) -> bytes:
    """The source with each quoted `#include` of a file under plugins/ replaced by that file's text (recursively; a
    header included twice is inlined once, as its `#pragma once` would have it): what NVRTC compiles without an
    include path, and what the cache key hashes.  An include that is missing or leaves plugins/ is a
    CubinUnavailable naming the source and the path."""
    seen = set() if _seen is None else _seen
    source = Path(source).resolve()
    seen.add(source)

    def inline(m: re.Match) -> bytes:
        name = m.group(1).decode(errors="replace")
        target = (source.parent / name).resolve()
        if not target.is_relative_to(PLUGINS) or not target.is_file():
            raise CubinUnavailable(f"{source.name}: #include \"{name}\" is not a file under {PLUGINS}")
        if target in seen:
            return b"// " + m.group(0).lstrip()  # already inlined above
        return source_text(target, seen)

    return _INCLUDE.sub(inline, source.read_bytes())


def source_sha256(source: Path) -> str:
    """sha256 (hex) of source_text(source): the version of a kernel source that a build records beside its cubin and
    the runtime's cache key hashes."""
    return hashlib.sha256(source_text(source)).hexdigest()


def register_cubin(path: Path, arch: str, op: str, stem: str) -> None:
    """An artifact's cubin of plugins/<op>/<stem>.cu for `arch` (built from the current source: the caller checks),
    which cubin() returns from now on instead of compiling (the latest registration wins)."""
    _BUILT[(arch, op, stem)] = Path(path)


def cubin(source: Path, arch: str, cache: Path) -> tuple[bytes, str]:
    """(cubin bytes, where it came from) of plugins/<op>/.../<stem>.cu for arch "sm_90" etc.; cache: the kdtree
    cache root."""
    built = _BUILT.get((arch, source.parent.name, source.stem))
    if built is not None and built.is_file():
        return built.read_bytes(), str(built)
    text = source_text(source)
    cached = cache / "kernels" / arch / f"{source.stem}-{hashlib.sha256(text).hexdigest()[:16]}.cubin"
    if cached.is_file():
        return cached.read_bytes(), str(cached)
    errors = []
    for compile_with in (_nvrtc, _nvcc):
        try:
            out = compile_with(text, source.name, compile_arch(text, arch))
        except CubinUnavailable as exc:
            errors.append(str(exc))
            continue
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(out)
        os.replace(tmp, cached)
        COMPILED.append(f"{source.name} for {arch}")
        return out, f"compiled by {compile_with.__name__.strip('_')} into {cached}"
    raise CubinUnavailable(f"{source.name} for {arch}: " + "; ".join(errors))


def _nvrtc(text: bytes, name: str, arch: str) -> bytes:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise CubinUnavailable("NVRTC: cuda.bindings.nvrtc not importable") from None
    try:
        err, prog = nvrtc.nvrtcCreateProgram(text, name.encode(), 0, [], [])
    except RuntimeError as exc:  # libnvrtc not found
        raise CubinUnavailable(f"NVRTC: {exc}") from None
    _nvrtc_ok(nvrtc, err, prog, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"-std=c++17"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcCompileProgram")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcGetCUBINSize")
        out = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, out)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcGetCUBIN")
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_ok(nvrtc, err, prog, what: str) -> None:
    if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return
    log = ""
    res = nvrtc.nvrtcGetProgramLogSize(prog)
    if res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS and res[1] > 1:
        buf = b" " * res[1]
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = next((ln for ln in buf.decode(errors="replace").splitlines() if "error" in ln), "")
    raise CubinUnavailable(f"NVRTC: {what}: {err.name}{': ' + log.strip() if log else ''}")


def _nvcc(text: bytes, name: str, arch: str) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CubinUnavailable("nvcc: not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / name, Path(tmp) / "out.cubin"
        src.write_bytes(text)
        res = subprocess.run([nvcc, "-O3", "-std=c++17", "-cubin", f"-arch={arch}", "-o", str(out), str(src)],
                             capture_output=True, text=True, check=False)
        if res.returncode:
            raise CubinUnavailable(f"nvcc: {(res.stderr.strip().splitlines() or ['failed'])[0]}")
        return out.read_bytes()


def load_module(source: Path, device, what: str) -> tuple[object, str]:
    """(CUmodule, where its cubin came from) of plugins/<op>/<stem>.cu on the CUDA device `device` (a torch device
    with an index), loaded through the driver API; RuntimeError naming `what` if the driver refuses it."""
    import torch
    from cuda.bindings import driver as cu

    from core.cache_dir import cache_root
    from plugins.common.device import device_facts
    from plugins.common.driver import checked

    data, where = cubin(source, device_facts(device).arch, cache_root())
    with torch.cuda.device(device.index):
        torch.cuda.init()
        return checked(cu, cu.cuModuleLoadData(data), f"{what}: cuModuleLoadData ({where})"), where
