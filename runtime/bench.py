"""`kdtree bench`: AR vs speculative decoding on one loaded model, graphs on and off, one table.

Per configuration (AR, chain, DDTree at each budget, fixed or auto; on CUDA each with graphs on and off) one
warm-up generation (which also captures the graphs) and one timed generation at T = 0 of the same
prompt.  Reported per row: decode tokens/s, tau (accepted tokens per round), rounds, wall µs per
round, GPU µs per round (CUDA events around each launch), host µs per round (Python work in the
host loop, waiting excluded), GPU idle fraction (1 - GPU time / decode wall time: the host
overhead the GPU actually sees), per-stage µs per round (eager rows: events around each stage),
and whether the tokens equal the AR row's; auto rows add the budgets their rounds verified.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from pathlib import Path

import torch

from core.provenance import git_commit
from runtime.decode.budget import CostCurve
from runtime.decode.stats import STAGES
from runtime.engine.engine import Engine

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"


def run_bench(path: str | Path, drafter: str | Path | None = None, budgets: tuple[int | str, ...] = (1, 4, 16, 64),
              max_new_tokens: int = 64, device: str = "cpu", prompt: str | None = None, chain: bool = True,
              dtype: torch.dtype | None = None, progress: bool = False, budget_curve: CostCurve | None = None) -> dict:
    """Run every configuration; returns {"meta": ..., "rows": [...], "summary": ...}.  budgets: integers, or
    "auto" / "auto:B_MAX" (budget_curve: their cost curve; None: stored or measured)."""
    eng = Engine.load(path, device=device, drafter=drafter, spec="none", graphs=True, dtype=dtype, progress=progress)
    ids = eng.encode(prompt or DEFAULT_PROMPT) if eng.tokenizer is not None else list(range(1, 17))
    configs = [("none", 0)]
    if eng.has_drafter:
        configs += ([("chain", 0)] if chain else []) + [("ddtree", b) for b in budgets]
    graph_modes = (True, False) if eng.device.type == "cuda" else (False,)
    rows, ar_tokens = [], None
    for spec, budget in configs:
        for graphs in graph_modes:
            curve = budget_curve if isinstance(budget, str) else None
            e = eng.configure(spec=spec, budget=budget or eng.budget, graphs=graphs, budget_curve=curve)
            list(e.generate_ids(ids, min(8, max_new_tokens)))  # warm-up: capture, Triton compiles
            out = list(e.generate_ids(ids, max_new_tokens))
            st = e.last_stats
            if spec == "none" and ar_tokens is None:
                ar_tokens = out
            rows.append(_row(spec, budget, graphs, st, out == ar_tokens))
    return {"meta": _meta(path, drafter, eng, ids, max_new_tokens), "rows": rows, "summary": _summary(rows)}


def _row(spec: str, budget: int, graphs: bool, st: dict, matches_ar: bool) -> dict:
    rounds = st.get("decode_rounds") or 0
    stage = st.get("stage_ms")
    wall_us = 1e6 * st["decode_s"] / rounds if rounds else None
    return {
        "mode": spec if spec != "ddtree" else f"ddtree-{budget}",
        "spec": spec, "budget": budget or None, "graphs": bool(st.get("graphs")), "graphs_asked": graphs,
        "graph_via": st.get("graph_via"), "graph_note": st.get("graph_note"),
        "new_tokens": st["new_tokens"], "decode_tokens_per_s": st.get("decode_tokens_per_s"),
        "tau": st.get("tau"), "rounds": rounds,
        "wall_us_per_round": round(wall_us, 2) if wall_us else None,
        "gpu_us_per_round": st.get("gpu_us_per_round"), "host_us_per_round": st.get("host_us_per_round"),
        "gpu_idle_frac": st.get("gpu_idle_frac"),
        "stage_us_per_round": {k: round(1e3 * stage[k] / rounds, 2) for k in STAGES} if stage and rounds else None,
        "matches_ar": matches_ar,
        "budget_histogram": st.get("budget_histogram"), "mean_budget": st.get("mean_budget"),
    }


def _meta(path, drafter, eng: Engine, ids: list[int], max_new_tokens: int) -> dict:
    try:
        import cuda.bindings as cb
        cb_version = getattr(cb, "__version__", "present")
    except ImportError:
        cb_version = None
    return {"model": str(path), "drafter": str(drafter) if drafter else None, "device": str(eng.device),
            "gpu": torch.cuda.get_device_name() if eng.device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(eng.dtype).replace("torch.", ""), "torch": torch.__version__,
            "cuda_bindings": cb_version, "prompt_tokens": len(ids), "max_new_tokens": max_new_tokens,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit()}


def _summary(rows: list[dict]) -> dict:
    ar = next((r for r in rows if r["spec"] == "none" and r["graphs"] == rows[0]["graphs"]), rows[0])
    best = max(rows, key=lambda r: r["decode_tokens_per_s"] or 0)
    graphed = [r for r in rows if r["graphs"]]
    idle = [r["gpu_idle_frac"] for r in graphed if r["gpu_idle_frac"] is not None]
    return {"ar_tokens_per_s": ar["decode_tokens_per_s"], "best_mode": best["mode"],
            "best_graphs": best["graphs"], "best_tokens_per_s": best["decode_tokens_per_s"],
            "speedup_vs_ar": round(best["decode_tokens_per_s"] / ar["decode_tokens_per_s"], 3)
            if ar["decode_tokens_per_s"] else None,
            "graph_rows": len(graphed), "max_gpu_idle_frac_with_graphs": max(idle) if idle else None,
            "host_overhead_within_5pct": (max(idle) <= 0.05) if idle else None,
            "all_match_ar": all(r["matches_ar"] for r in rows)}


def format_table(result: dict) -> str:
    """The one table: a row per configuration."""
    head = (f"{'mode':<12}{'graphs':>7}{'tok/s':>10}{'tau':>7}{'rounds':>7}{'wall us':>10}{'gpu us':>10}"
            f"{'host us':>9}{'idle':>7}  {'stages us (draft/build/verify/accept/commit)':<46}{'=AR':>4}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        st = r["stage_us_per_round"]
        stages = "/".join(f"{st[k]:.0f}" for k in STAGES) if st else "-"

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        lines.append(f"{r['mode']:<12}{('on' if r['graphs'] else 'off'):>7}{f(r['decode_tokens_per_s'], '.1f'):>10}"
                     f"{f(r['tau'], '.2f'):>7}{r['rounds']:>7}{f(r['wall_us_per_round'], '.0f'):>10}"
                     f"{f(r['gpu_us_per_round'], '.0f'):>10}{f(r['host_us_per_round'], '.0f'):>9}"
                     f"{f(r['gpu_idle_frac'], '.3f'):>7}  {stages:<46}{('yes' if r['matches_ar'] else 'NO'):>4}")
    m, s = result["meta"], result["summary"]
    lines.append(f"{m['device']} ({m['gpu']}), {m['dtype']}, prompt {m['prompt_tokens']} tokens, "
                 f"{m['max_new_tokens']} new; best {s['best_mode']} graphs {'on' if s['best_graphs'] else 'off'} "
                 f"{s['speedup_vs_ar']}x AR; max GPU idle with graphs {s['max_gpu_idle_frac_with_graphs']}")
    notes = sorted({r["graph_note"] for r in result["rows"] if r["graph_note"]})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def write_result(result: dict, out_dir: str | Path, name: str) -> Path:
    path = Path(out_dir) / f"bench-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
