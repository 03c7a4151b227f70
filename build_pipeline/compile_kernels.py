"""Ahead-of-time kernel compilation: plugins' CUDA C and Triton kernels -> cubin per arch, plus PTX.

No GPU is needed: nvcc compiles `plugins/**/*.cu` with `-cubin -arch=sm_XX` (and `-ptx
-arch=compute_XX` for the PTX fallback a newer GPU can JIT), and Triton compiles through
`triton.compile(ASTSource(...), target=GPUTarget("cuda", XX, 32))`.

Triton kernels are declared by their plugin: `plugins/<op>/aot.py` defines
`aot_kernels(budgets: tuple[int, ...]) -> list[TritonKernel]` (plugins/common/aot.py; one entry per
specialisation, e.g. a BLOCK per tree budget).  They compile in a subprocess without TRITON_INTERPRET
(tests set it to run kernels on the CPU), which also keeps Triton's global state out of the build process.

Output: kernels/<arch>/<op>/<name>.cubin, .ptx, and for Triton a .json of what a launcher needs
(kernel symbol, num_warps, shared memory, scratch sizes, signature, constexprs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from core.errors import KdtreeError
from core.progress import Progress
from plugins.common.aot import TritonKernel
from plugins.common.cubin import compile_arch, source_sha256

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "plugins"
_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


def parse_archs(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """"sm_90,sm_120" -> ("sm_90", "sm_120"); "none" or "" -> (); anything else names --arch."""
    items = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if items in ([], ["none"]):
        return ()
    for a in items:
        if not _ARCH.match(a):
            raise KdtreeError(f"--arch {a!r} is not a CUDA arch like sm_90 or sm_120 (or 'none')")
    return tuple(dict.fromkeys(items))


def cuda_sources() -> list[Path]:
    return sorted(PLUGINS.rglob("*.cu"))


def triton_modules() -> list[str]:
    """The ops' `plugins.<op>.aot` modules (plugins/common/aot.py is the TritonKernel type, not an op)."""
    return [f"plugins.{p.parent.name}.aot" for p in sorted(PLUGINS.glob("*/aot.py")) if p.parent.name != "common"]


def compile_all(out: Path, archs: tuple[str, ...], budgets: tuple[int, ...], progress: bool = True,
                modules: list[str] | None = None) -> list[dict]:
    """Compile every plugin kernel for every arch into out/kernels/; returns manifest records."""
    if not archs:
        return []
    records: list[dict] = []
    sources = cuda_sources()
    if sources and shutil.which("nvcc") is None:
        # the CUDA C kernels (budget auto's setter, moe_w4a16 v3) are also compiled by the runtime itself at
        # first use (NVRTC or nvcc, plugins/common/cubin.py): a build without nvcc ships Triton's cubins only
        print(f"kdtree build: nvcc not on PATH: {len(sources)} CUDA C kernel(s) not compiled "
              f"({', '.join(s.name for s in sources)}); the runtime compiles them at first use", file=sys.stderr)
        sources = []
    bar = Progress(len(sources) * len(archs), "compiling CUDA C", enabled=progress and bool(sources))
    for src in sources:
        for arch in archs:
            records += compile_cuda(src, arch, out)
            bar.advance()
    bar.close()
    modules = triton_modules() if modules is None else modules
    if modules:
        records += _compile_triton_subprocess(modules, archs, budgets, out, progress)
    return records


def compile_cuda(src: Path, arch: str, out: Path) -> list[dict]:
    """nvcc: src -> kernels/<arch>/<op>/<stem>.cubin and .ptx (compute_XX, the JIT fallback)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise KdtreeError(f"nvcc not found on PATH: needed to compile {_shown(src)} for --arch {arch} "
                          f"(install the CUDA toolkit, or pass --arch none)")
    op = src.relative_to(PLUGINS).parts[0]
    rel = Path("kernels") / arch / op
    (out / rel).mkdir(parents=True, exist_ok=True)
    m = _ARCH.match(arch)
    common = [nvcc, "-O3", "-std=c++17", "-lineinfo", f"-I{PLUGINS}", f"-I{src.parent}"]
    cubin, ptx = rel / (src.stem + ".cubin"), rel / (src.stem + ".ptx")
    cubin_arch = compile_arch(src.read_bytes(), arch)  # sm_90a for a source that uses wgmma
    for cmd in ([*common, "-cubin", f"-arch={cubin_arch}", "-o", str(out / cubin), str(src)],
                [*common, "-ptx", f"-arch=compute_{m.group(1)}{m.group(2)}", "-o", str(out / ptx), str(src)]):
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
            raise KdtreeError(f"nvcc failed on {_shown(src)} for {arch}: {first}")
    return [{"kind": "cuda", "op": op, "name": src.stem, "arch": arch, "source": str(_shown(src)),
             "source_sha256": source_sha256(src), "cubin": cubin.as_posix(), "ptx": ptx.as_posix()}]


def compile_triton(kernel: TritonKernel, arch: str, out: Path) -> dict:
    """One Triton specialisation for one arch (call only where TRITON_INTERPRET is unset)."""
    import triton
    from triton.backends.compiler import GPUTarget

    cap = int(_ARCH.match(arch).group(1))
    src = triton.compiler.ASTSource(fn=kernel.fn, signature=kernel.signature, constexprs=kernel.constexprs,
                                    attrs=kernel.attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    rel = Path("kernels") / arch / kernel.op
    (out / rel).mkdir(parents=True, exist_ok=True)
    md = compiled.metadata
    meta = {"symbol": md.name, "num_warps": md.num_warps, "num_ctas": md.num_ctas, "shared": md.shared,
            "global_scratch_size": md.global_scratch_size, "profile_scratch_size": md.profile_scratch_size,
            "target": [md.target.backend, md.target.arch, md.target.warp_size],
            "signature": kernel.signature, "constexprs": {k: str(v) for k, v in kernel.constexprs.items()},
            "triton": triton.__version__}
    (out / rel / (kernel.name + ".cubin")).write_bytes(compiled.asm["cubin"])
    (out / rel / (kernel.name + ".ptx")).write_text(compiled.asm["ptx"])
    (out / rel / (kernel.name + ".json")).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return {"kind": "triton", "op": kernel.op, "name": kernel.name, "arch": arch, "symbol": md.name,
            "cubin": (rel / (kernel.name + ".cubin")).as_posix(), "ptx": (rel / (kernel.name + ".ptx")).as_posix(),
            "meta": (rel / (kernel.name + ".json")).as_posix()}


def _shown(path: Path) -> str:
    """A source path relative to the repo when inside it (manifests stay machine-independent)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def _compile_triton_subprocess(modules: list[str], archs: tuple[str, ...], budgets: tuple[int, ...], out: Path,
                               progress: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "build_pipeline.compile_kernels", "--out", str(out), "--arch", ",".join(archs),
           "--budgets", ",".join(map(str, budgets)), "--modules", ",".join(modules)]
    if progress:
        sys.stderr.write(f"{'compiling Triton':<18} {len(modules)} module(s) x {len(archs)} arch(s)\n")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), check=False)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KdtreeError(f"Triton AOT compilation failed: {last}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _main() -> None:
    """Subprocess entry: compile the Triton kernels of --modules; print the records as one JSON line."""
    import argparse
    import importlib

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--budgets", default="")
    ap.add_argument("--modules", required=True)
    a = ap.parse_args()
    budgets = tuple(int(b) for b in a.budgets.split(",") if b)
    records = []
    for name in a.modules.split(","):
        for kernel in importlib.import_module(name).aot_kernels(budgets):
            for arch in parse_archs(a.arch):
                records.append(compile_triton(kernel, arch, Path(a.out)))
    print(json.dumps(records))


if __name__ == "__main__":
    _main()
