"""Shared pieces of the benchmark scripts: hardware ceilings, roofline, timing, result files.

The memory ceiling is this GPU's device-to-device copy (bytes read + written), measured once per run
(plugins/common/device.copy_bytes_per_s): the H200's came to 4.25 TB/s (DESIGN.md "Measured on an H200"), and an
H100's rooflines divide by the H100's own rate (before 2026-12-06 every run divided by the H200's).  The bf16
tensor ceiling is the H200's measured large GEMM (the H100 has the same chip).  Without a GPU: the H200's numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path
from typing import Any, Callable

from core.provenance import git_commit

HBM_BYTES_PER_S = 4.25e12  # the H200's measured copy rate: the ceiling without a GPU
BF16_FLOPS_PER_S = 687e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def hbm_bytes_per_s() -> float:
    """The memory ceiling of this run: the current GPU's measured copy rate, or HBM_BYTES_PER_S without one."""
    import torch

    from plugins.common.device import copy_bytes_per_s
    return copy_bytes_per_s(torch.cuda.current_device()) if torch.cuda.is_available() else HBM_BYTES_PER_S


def roofline_us(bytes_moved: float, flops: float = 0.0) -> float:
    """The floor in µs: max(bytes / HBM bandwidth, flops / bf16 tensor rate)."""
    return max(bytes_moved / hbm_bytes_per_s(), flops / BF16_FLOPS_PER_S) * 1e6


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def versions() -> dict[str, str]:
    import torch
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def kernel_us(fn: Callable[[], Any], reps: int = 20, warmup: int = 3,
              name_chars: int | None = None) -> dict[str, float]:
    """Mean device µs per fn() call of each CUDA kernel it launches, by kernel name (torch profiler / CUPTI, eager
    calls after `warmup` untimed ones): the per-launch view, where time_us gives the whole.  name_chars: keyed by
    the names' first name_chars characters instead (kernels sharing them summed)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            key = ev.name[:name_chars] if name_chars else ev.name
            out[key] = out.get(key, 0.0) + ev.device_time / reps
    return out


def time_us(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100, graph: bool = False) -> float:
    """Median µs of fn() on the current CUDA stream, timed with events (triton.testing.do_bench);
    graph=True captures fn in a CUDA graph first and times replays (for launch-bound ops)."""
    import torch
    import triton.testing
    if graph:
        fn()  # compile / warm caches outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(g, stream=stream):
                fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def write_result(op: str, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None,
                 out_dir: str | Path | None = None) -> Path:
    """Writes <out_dir or benchmarks/results>/<op>.json: date, commit, GPU, versions, rows."""
    doc = {"op": op, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "gpu": gpu_name(), "versions": versions(),
           "ceilings": {"hbm_bytes_per_s": round(hbm_bytes_per_s(), -9), "bf16_flops_per_s": BF16_FLOPS_PER_S,
                        "hbm_source": "this GPU's device copy, measured in this run" if gpu_name() != "cpu"
                        else "the H200's measured copy (no GPU)"},
           "rows": rows, **(extra or {})}
    path = Path(out_dir or RESULTS_DIR) / f"{op}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    """A fixed-width table of the given columns (floats to 3 significant digits)."""
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def add_rank_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark that loads one K2.6 TP rank once (runtime/bench_rank.load_rank_models) and times
    its captured steps: --out, --source, --tp, --context, --iters, --layers."""
    ap.add_argument("--out", default=None)
    ap.add_argument("--source", default="kimi-k2.6", help="a preset (tiny-kimi with --tp 1 --context 512: the tiny "
                    "model's step) or a synthetic artifact")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layers", type=int, default=None)


def parse_combinations(text: str, known, flag: str, what: str, named: dict[str, frozenset[str]]
                       ) -> list[tuple[str, frozenset[str]]]:
    """"a,b+c" -> [("a", {"a"}), ("b+c", {"b", "c"})]: comma-separated settings, each a "+"-joined set of `known`
    names and `named` ones (a name standing for its set, e.g. "base": none, so "default+x" is the defaults and x).
    An unknown part is a ValueError naming the flag, the part and the known names."""
    out = []
    for name in text.split(","):
        parts = frozenset().union(*(named.get(part, {part}) for part in name.split("+")))
        unknown = sorted(parts - set(known))
        if unknown or not name:
            raise ValueError(f"{flag}: unknown {what} {unknown or [name]} (known: {', '.join([*named, *known])})")
        out.append((name, parts))
    return out
