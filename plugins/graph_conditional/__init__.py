"""The setter kernel of budget auto's conditional graph nodes (set_conditionals.cu) as a cubin for one GPU arch.

A captured budget-auto round (runtime/decode/conditional.py) holds one IF node per tree-size bucket; a
kernel node right before them copies the device's one-hot choice into the IF nodes' conditional handles
(cudaGraphSetConditional, callable only from device code).  This module hands out that kernel's cubin,
found in order:

  1. the artifact's kernels/<arch>/graph_conditional/set_conditionals.cubin (`kdtree build` compiles
     plugins/**/*.cu with nvcc, build_pipeline/compile_kernels.py);
  2. the kdtree cache: <cache>/kernels/<arch>/set_conditionals-<source sha>.cubin;
  3. compiled now, by NVRTC (cuda.bindings.nvrtc) or else nvcc, and stored in the cache (~0.1 s, once
     per machine and source).

SetterUnavailable names what is missing when none of them gives one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("set_conditionals.cu")
KERNEL = b"kdtree_set_conditionals"  # (const u64* handles [n], const bool* hot [n], int n)


class SetterUnavailable(RuntimeError):
    """No cubin of the setter kernel for this arch could be found or compiled."""


def setter_cubin(arch: str, cache: Path, artifact_kernels: Path | None = None) -> tuple[bytes, str]:
    """(cubin bytes, where it came from) for arch "sm_90" etc.; cache: the kdtree cache root;
    artifact_kernels: an artifact's kernels/ folder, or None."""
    if artifact_kernels is not None:
        built = artifact_kernels / arch / "graph_conditional" / (SOURCE.stem + ".cubin")
        if built.is_file():
            return built.read_bytes(), str(built)
    text = SOURCE.read_bytes()
    cached = cache / "kernels" / arch / f"{SOURCE.stem}-{hashlib.sha256(text).hexdigest()[:16]}.cubin"
    if cached.is_file():
        return cached.read_bytes(), str(cached)
    errors = []
    for compile_with in (_nvrtc, _nvcc):
        try:
            cubin = compile_with(text, arch)
        except SetterUnavailable as exc:
            errors.append(str(exc))
            continue
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, cached)
        return cubin, f"compiled by {compile_with.__name__.strip('_')} into {cached}"
    raise SetterUnavailable(f"{SOURCE.name} for {arch}: " + "; ".join(errors))


def _nvrtc(text: bytes, arch: str) -> bytes:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise SetterUnavailable("NVRTC: cuda.bindings.nvrtc not importable") from None
    try:
        err, prog = nvrtc.nvrtcCreateProgram(text, SOURCE.name.encode(), 0, [], [])
    except RuntimeError as exc:  # libnvrtc not found
        raise SetterUnavailable(f"NVRTC: {exc}") from None
    _nvrtc_ok(nvrtc, err, prog, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcCompileProgram")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _nvrtc_ok(nvrtc, err, prog, "nvrtcGetCUBIN")
        return cubin
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
        log = buf.decode(errors="replace").strip().splitlines()[0]
    raise SetterUnavailable(f"NVRTC: {what}: {err.name}{': ' + log if log else ''}")


def _nvcc(text: bytes, arch: str) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SetterUnavailable("nvcc: not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / SOURCE.name, Path(tmp) / "out.cubin"
        src.write_bytes(text)
        res = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-o", str(out), str(src)], capture_output=True,
                             text=True, check=False)
        if res.returncode:
            raise SetterUnavailable(f"nvcc: {(res.stderr.strip().splitlines() or ['failed'])[0]}")
        return out.read_bytes()
