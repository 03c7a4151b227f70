"""The compiled kernels (plugins/**/*.cu as sm_90 and sm_120 SASS, the ahead-compiled Triton ones as sm_90: nvcc /
triton and cuobjdump, no GPU): nothing the predecessor grid writes is read before the kernel's griddepcontrol.wait
(SASS ACQBULK).

Under programmatic dependent launch a kernel starts while its predecessor still runs, so what may go before its wait
is what no kernel of the round writes: weights and scales (.nc with L1::no_allocate: LDG.E.NA), L2 prefetches
(UBLKPF) and 32-bit L2 loads (LDG.E.STRONG.GPU) of the routing's counts and lists, which a kernel two launches back
wrote.  A token or activation load (a 64- or 128-bit LDG without .NA) above the wait reads the predecessor's output
before it is complete: moe_v3.cu's down had exactly that until 2026-12-06 (ptxas hoisted its .nc h loads above the
wait once their addresses were known early), and no GPU test could see it while the stale data equalled the new.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "plugins").rglob("*.cu"))  # what kdtree build compiles (build_pipeline/compile_kernels.py)
SOURCES += sorted((ROOT / "benchmarks" / "cuda").glob("*.cu"))  # and the benchmarks' own kernels (boundary_cost.cu)


def _cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel (the test extras), with nvdisasm beside it."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13 as wheels  # the wheels' namespace package
    except ImportError:
        return None
    for base in wheels.__path__:
        tool = Path(base) / "bin" / "cuobjdump"
        if tool.exists() and (tool.parent / "nvdisasm").exists():
            return str(tool)
    return None




# kernels whose copies into shared memory above the wait (cp.async: SASS LDGSTS) are of model constants only, which
# the SASS cannot tell from activations: each is named here with what it copies (reviewed in the source)
CONSTANT_COPIES = {"kdtree_moe_v3_one": "the shared expert's down weights (sd_w; moe_v3.cu, launch_v3.ONE_SHARED)"}


def allowed(line: str, kernel: str = "") -> bool:
    """An LDG allowed above the wait: .NA (weights, scales) or a 32-bit strong L2 load (routing counts / lists); in
    the kernels of CONSTANT_COPIES, cp.async copies (LDGSTS) too."""
    op = next(tok for tok in line.split() if tok.startswith("LDG"))  # the opcode with its modifiers
    if op.startswith("LDGSTS"):
        return kernel in CONSTANT_COPIES
    return ".NA." in op or (op.startswith("LDG.E.STRONG.GPU") and ".64" not in op and ".128" not in op)


def _functions(sass: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> {kernel: its instruction lines in address order}."""
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            out[name].append(line.strip())
    return out


def violations(sass: str) -> dict[str, list[str]]:
    """{kernel: loads above its last ACQBULK that are not allowed there} (kernels without a wait are skipped).  The
    last one: a kernel may hold a wait on each side of a branch (down's, waiting first or late, before 2026-12-06),
    and a load between them runs before the wait on one of the paths."""
    bad = {}
    for name, lines in _functions(sass).items():
        waits = [i for i, ln in enumerate(lines) if "ACQBULK" in ln]
        if not waits:
            continue
        # LDG only: a TMA load above the wait (UTMALDG, skinny_wgmma's first weight tiles) is not classified by its
        # SASS; that source issues the token tiles' after griddepcontrol.wait, both asm volatile with memory clobbers
        early = [ln for ln in lines[:waits[-1]] if re.search(r"\bLDG", ln) and not allowed(ln, name)]
        if early:
            bad[name] = early
    return bad


def test_the_rule_flags_a_token_load_above_the_wait():
    """The checker itself: a 128-bit .nc load (down's h before the fix) above ACQBULK is flagged, weights are not."""
    sass = """
        Function : k
        /*0100*/                   LDG.E.NA.128.CONSTANT R56, desc[UR10][R120.64] ;
        /*0110*/                   LDG.E.STRONG.GPU R5, desc[UR10][R4.64] ;
        /*0120*/              @!P4 LDG.E.128.CONSTANT R32, desc[UR10][R2.64] ;
        /*0130*/                   ACQBULK ;
        /*0138*/                   LDG.E.128.CONSTANT R40, desc[UR10][R2.64] ;
        /*0139*/                   ACQBULK ;
        /*0140*/                   LDG.E.128.STRONG.GPU R32, desc[UR10][R2.64] ;
    """
    assert list(violations(sass)) == ["k"] and len(violations(sass)["k"]) == 2  # both waits' sides
    assert violations(sass.replace("LDG.E.128.CONSTANT", "LDG.E.NA.64.CONSTANT")) == {}
    # a cp.async above the wait: flagged but in the kernels named in CONSTANT_COPIES
    copy = "\n        /*0100*/                   LDGSTS.E.BYPASS.128 [R19+0x6100], desc[UR8][R12.64] ;\n"
    wait = "        /*0130*/                   ACQBULK ;\n"
    assert list(violations("Function : k" + copy + wait)) == ["k"]
    assert violations("Function : kdtree_moe_v3_one" + copy + wait) == {}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])  # the archs with griddepcontrol that kdtree build targets
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_round_data_is_read_above_the_pdl_wait(source, arch, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from plugins.common.cubin import compile_arch
    cubin = tmp_path / (source.stem + ".cubin")
    subprocess.run([shutil.which("nvcc"), "-cubin", f"-arch={compile_arch(source.read_bytes(), arch)}", "-std=c++17",
                    "-o", str(cubin), str(source)], check=True)
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    sass = subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True, text=True, env=env).stdout
    functions = _functions(sass)
    if source.name in ("moe_v3.cu", "moe_wgmma.cu", "skinny_gemm.cu", "l2_prefetch.cu", "tree_verify_wgmma.cu",
                       "skinny_wgmma.cu", "boundary_cost.cu"):  # they wait (PDL)
        assert sum("ACQBULK" in "".join(lines) for lines in functions.values()) >= 1, "no PDL wait in the SASS"
    assert violations(sass) == {}


AOT_MODULES = sorted(p.parent.name for p in (ROOT / "plugins").glob("*/aot.py")
                     if "def aot_kernels" in p.read_text())


@pytest.mark.parametrize("plugin", AOT_MODULES)
def test_triton_kernels_read_nothing_above_their_pdl_wait(plugin, tmp_path):
    """The same rule on the Triton kernels kdtree build compiles ahead (each plugin's aot.py; the first two
    specialisations): Triton emits weak `ld.global` (never .nc), which ptxas keeps below the wait."""
    import importlib

    from build_pipeline.compile_kernels import compile_triton
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    kernels = importlib.import_module(f"plugins.{plugin}.aot").aot_kernels((16,))[:2]
    assert kernels
    for kernel in kernels:
        rec = compile_triton(kernel, "sm_90", tmp_path)
        sass = subprocess.run([tool, "-sass", str(tmp_path / rec["cubin"])], check=True, capture_output=True,
                              text=True, env=env).stdout
        assert violations(sass) == {}, kernel.name
