"""GPU: an artifact built with the Triton warm-up decodes in a fresh process without compiling anything.

The tiny INT4 kimi_k25 model with a drafter is built for this GPU's arch with warm=True (or KDTREE_WARMED_ART
names one) (build_pipeline/kernel_cache.py); a fresh process with an empty TRITON_CACHE_DIR (this file run as a
script, `--probe ART`) loads it on CUDA and decodes AR and DDTree (budget 16, and auto: `kdtree run`'s default on
CUDA) with graphs on, counting Triton compiles through triton.knobs.compilation.listener (cache hits are reported
to it too), C launcher builds through triton.runtime.build._build, Dynamo / Inductor compiles through
torch._dynamo's counters and CUDA C cubins compiled at run through plugins/common/cubin.COMPILED (they must come
from the artifact's kernels/); budget auto must find the cost curve the warm-up stored in ART/autotune.  The same
probe on a copy whose manifest names another arch takes the JIT path: it must warn, compile (so the counters are
seen to count) and give the same tokens.

Writes $KDTREE_RESULTS_DIR/kernel-cache-device-test.json when that is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
BUDGET = 16
NEW = 24
PROMPT_LENGTHS = (5, 16, 29)  # Triton's "other", "% 16" buckets; 29 is not a warm-up length
REPORT: dict = {}


@pytest.fixture(scope="module")
def warmed(tiny, tmp_path_factory):
    """The tiny artifact built with the warm-up here, or KDTREE_WARMED_ART's (benchmarks/startup_device.sh
    builds one with `kdtree build` and hands it over, to stay within one device call)."""
    from build_pipeline.build import build
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from plugins.common.device import arch_of

    given = os.environ.get("KDTREE_WARMED_ART")
    if given:
        REPORT["artifact"] = given
        return Path(given)
    root = tmp_path_factory.mktemp("kcache-gpu")
    model = tiny.get("kimi", int4=True, kimi25=True)
    drafter = make_tiny_drafter(model, root / "drafter")
    t0 = time.perf_counter()
    arch = arch_of(torch.cuda.get_device_capability())  # the CUDA C kernels' cubins in the artifact too
    res = build(model, out=root / "art", drafter_dir=drafter, archs=arch, budgets=(BUDGET,), progress=False,
                warm=True)
    REPORT["build_s"] = round(time.perf_counter() - t0, 1)
    REPORT["triton_cache"] = res.manifest["triton_cache"]
    return res.art_dir


def probe(art: Path, triton_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(triton_dir), PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, __file__, "--probe", str(art)], capture_output=True, text=True, env=env,
                         cwd=str(REPO), timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["stderr"] = res.stderr
    return out


def test_warm_artifact_compiles_nothing(warmed, tmp_path):
    from plugins.common.device import arch_of

    rec = json.loads((warmed / "manifest.json").read_text())["triton_cache"]
    assert rec["warmed"] and rec["arch"] == arch_of(torch.cuda.get_device_capability()) and rec["entries"] > 0
    before = {p: p.stat().st_mtime_ns for p in (warmed / rec["dir"]).rglob("*")}
    hot = probe(warmed, tmp_path / "triton-empty")
    REPORT["warm"] = {k: v for k, v in hot.items() if k != "stderr"}
    assert "KernelCacheWarning" not in hot["stderr"]
    assert hot["hits"] > 0, "the listener saw no kernel at all: the probe ran no Triton kernel"
    assert hot["compiles"] == [], f"Triton compiled {len(hot['compiles'])} kernels: {hot['compiles'][:5]}"
    assert hot["launcher_builds"] == 0
    assert hot["dynamo_frames"] == 0 and hot["inductor"] == 0
    assert hot["cubin_compiles"] == [], f"CUDA C compiled at run: {hot['cubin_compiles']}"
    assert hot["auto_curve"].startswith("stored"), f"budget auto measured its cost curve: {hot['auto_curve']}"
    assert {p: p.stat().st_mtime_ns for p in (warmed / rec["dir"]).rglob("*")} == before  # only read

    # the JIT path: a copy whose kernels are for another arch warns, compiles, and decodes the same tokens
    other = tmp_path / "other-arch"
    shutil.copytree(warmed, other, ignore=shutil.ignore_patterns(".verified"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["triton_cache"]["arch"] = "sm_10"
    (other / "manifest.json").write_text(json.dumps(manifest))
    cold = probe(other, tmp_path / "triton-jit")
    REPORT["jit"] = {k: v for k, v in cold.items() if k not in ("stderr", "compiles")} | \
        {"compiles": len(cold["compiles"])}
    assert "KernelCacheWarning" in cold["stderr"] and "holds kernels for sm_10" in cold["stderr"]
    assert len(cold["compiles"]) > 0
    assert cold["tokens"] == hot["tokens"]
    _write_report()


def _write_report() -> None:
    out = os.environ.get("KDTREE_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kernel-cache-device-test.json").write_text(json.dumps(REPORT, indent=1) + "\n")


def _probe_main(art: str) -> None:
    """Load ART on CUDA and decode AR and DDTree (budget 16 and auto; graphs on) with every compile counted; one
    JSON line."""
    import triton
    import triton.runtime.build as triton_build

    compiles: list[str] = []
    hits = [0]

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            hits[0] += 1
        else:
            compiles.append(str(metadata.get("name", getattr(src, "name", "?"))))

    triton.knobs.compilation.listener = listener
    launcher_builds = [0]
    real_build = triton_build._build

    def counted_build(*args, **kwargs):
        launcher_builds[0] += 1
        return real_build(*args, **kwargs)

    triton_build._build = counted_build
    from runtime import Engine

    t0 = time.perf_counter()
    eng = Engine.load(art, device="cuda", spec="ddtree", budget=BUDGET, graphs=True)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    tokens = {}
    for spec, budget in (("none", None), ("ddtree", None), ("ddtree", "auto")):
        e = eng.configure(spec=spec, budget=budget)
        tokens[spec if budget is None else f"{spec}-{budget}"] = [list(e.generate_ids(p, NEW, 0.0, seed=0))
                                                                  for p in prompts]
    torch.cuda.synchronize()
    auto_curve = str(e.last_stats.get("budget_curve"))  # "stored: ART/autotune/...": the build's warm-up measured it
    from plugins.common.cubin import COMPILED
    dynamo = "torch._dynamo" in sys.modules
    frames = inductor = 0
    if dynamo:
        from torch._dynamo.utils import counters
        frames = sum(counters["frames"].values()) if "frames" in counters else 0
        inductor = sum(counters["inductor"].values()) if "inductor" in counters else 0
    print(json.dumps({"tokens": tokens, "compiles": compiles, "hits": hits[0], "launcher_builds": launcher_builds[0],
                      "cubin_compiles": COMPILED, "auto_curve": auto_curve,
                      "dynamo_imported": dynamo, "dynamo_frames": frames, "inductor": inductor,
                      "load_s": round(load_s, 2), "total_s": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe_main(sys.argv[2])
