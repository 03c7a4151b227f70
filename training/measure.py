"""tau and speed of a (target, drafter) pair through the real Engine, on held-out prompts.

Modes: AR (spec none), the DFlash chain, DDTree at each budget; temperatures as given.  At T = 0 every
speculative mode must give exactly the AR tokens (lossless): `identical_to_ar` records it.  Speedup is
decode tokens/s over AR's at the same temperature on the same device.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from training.corpus import read_split


def heldout_prompts(corpus_dir: str | Path, n: int, context_chars: int = 400) -> list[str]:
    """n prompts from the held-out files, evenly spread: the text before a `def` line, that line
    included (the model writes the body)."""
    docs = read_split(corpus_dir, "eval")
    prompts = []
    for path, text in docs:
        at = text.find("\ndef ", context_chars // 2)
        at = at if at >= 0 else text.find("\n    def ", context_chars // 2)
        if at < 0:
            continue
        end = text.find("\n", at + 1)
        prompts.append(text[max(0, at - context_chars): end + 1])
    if not prompts:
        raise ValueError(f"{corpus_dir}: no held-out file has a `def` line to prompt with")
    step = max(len(prompts) / n, 1.0)
    return [prompts[int(i * step)] for i in range(min(n, len(prompts)))]


def measure_pair(target_dir: str | Path, drafter_dir: str | Path, prompts: list[str], budgets: list[int],
                 temperatures: list[float], max_new_tokens: int = 64, device: str = "cpu",
                 chain: bool = True, seed: int = 0, dtype: torch.dtype | None = None, auto: int | None = None) -> dict:
    """dtype: the Engine's (None: fp32 on CPU, bf16 on CUDA); auto: also run `--budget auto:<auto>` (mode
    ddtree-auto; its rows carry the rounds per verified bucket, the mean bucket and the rounds per built
    tree), then ddtree-auto-full: the same with the auto session's curve less its head_us, so every round
    builds the full tree (the choice without caps, runtime/decode/budget.py)."""
    import dataclasses

    from runtime.engine.engine import Engine

    eng = Engine.load(target_dir, device=device, drafter=drafter_dir, spec="ddtree", budget=budgets[0], dtype=dtype)
    modes = [("ar", "none", 0)] + ([("chain", "chain", 0)] if chain else []) + [
        (f"ddtree-{b}", "ddtree", b) for b in budgets] + ([("ddtree-auto", "ddtree", f"auto:{auto}"),
                                                           ("ddtree-auto-full", "ddtree", f"auto:{auto}")]
                                                          if auto else [])
    results = {"target": str(target_dir), "drafter": str(drafter_dir), "device": device,
               "dtype": str(eng.dtype).replace("torch.", ""), "prompts": len(prompts),
               "max_new_tokens": max_new_tokens, "runs": []}
    for temp in temperatures:
        ar_ids: list[list[int]] = []
        ar_tps = None
        full_tree = None  # the curve of ddtree-auto-full, from the ddtree-auto session
        for label, spec, budget in modes:
            e = eng.configure(spec=spec, budget=budget or eng.budget,
                              budget_curve=full_tree if label == "ddtree-auto-full" else None)
            list(e.generate_ids(prompts[0], max_new_tokens=8, temperature=temp, seed=seed))  # warm the session
            new = rounds = 0
            decode_s = 0.0
            outs = []
            buckets: dict[int, int] = {}
            caps: dict[int, int] = {}
            t0 = time.monotonic()
            for i, p in enumerate(prompts):
                ids = list(e.generate_ids(p, max_new_tokens=max_new_tokens, temperature=temp, seed=seed + i))
                st = e.last_stats
                outs.append(ids)
                new += st["new_tokens"]
                rounds += st["rounds"]
                decode_s += st["decode_s"]
                for b, k in st.get("budget_histogram", {}).items():
                    buckets[int(b)] = buckets.get(int(b), 0) + k
                for b, k in st.get("budget_caps", {}).items():
                    caps[int(b)] = caps.get(int(b), 0) + k
            wall = time.monotonic() - t0
            tps = new / decode_s if decode_s > 0 else None
            row = {"mode": label, "temperature": temp, "budget": budget or None, "new_tokens": new,
                   "rounds": rounds, "tau": round(new / rounds, 4) if rounds else None,
                   "decode_tokens_per_s": round(tps, 2) if tps else None, "wall_s": round(wall, 3)}
            row["graphs"] = e.last_stats.get("graphs")
            if e.last_stats.get("graph_note"):
                row["graph_note"] = e.last_stats["graph_note"]
            if buckets:
                row["budget_histogram"] = dict(sorted(buckets.items()))
                row["mean_budget"] = round(sum(b * k for b, k in buckets.items()) / sum(buckets.values()), 2)
                row["budget_curve"] = e.last_stats.get("budget_curve")
                row["budget_caps"] = dict(sorted(caps.items()))
                row["mean_cap"] = round(sum(b * k for b, k in caps.items()) / sum(caps.values()), 2)
            if label == "ddtree-auto":
                curve = e.runner._sessions[(*e.spec_config.key, 1)].choice.curve  # the batch-1 session's
                row["curve"] = curve.to_dict()
                full_tree = dataclasses.replace(curve, head_us=(), source=f"{curve.source}; head_us dropped")
            if spec == "none":
                ar_ids, ar_tps = outs, tps
            else:
                row["speedup_vs_ar"] = round(tps / ar_tps, 3) if tps and ar_tps else None
                if temp == 0:
                    row["identical_to_ar"] = outs == ar_ids
                    row["first_diff"] = [first_diff(a, o) for a, o in zip(ar_ids, outs)]  # per prompt; None = equal
            if temp == 0:
                results.setdefault("ids_t0", {})[label] = outs
            results["runs"].append(row)
    eng.close()
    return results


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter's length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_margins(target_dir: str | Path, prompts: list[str], ids_t0: dict[str, list[list[int]]],
                       device: str = "cpu", dtype: torch.dtype = torch.float64) -> list[dict]:
    """Where a T = 0 run's tokens leave AR's: the target's logits there, recomputed at `dtype` (fp64 on
    the CPU by default), for AR's token and the run's.  A gap of a few bf16 rounding steps says the two
    tokens were a near-tie that the bf16 GPU forward of 1 token (AR) and of a tree (verify) resolved
    differently; a large gap would be a wrong token.  One row per (mode, prompt) that diverges."""
    from runtime.decode.prefill import prefill
    from runtime.engine.engine import Engine

    eng = Engine.load(target_dir, device=device, spec="none", dtype=dtype)
    model = eng.runner.target
    rows = []
    for mode, outs in ids_t0.items():
        if mode == "ar":
            continue
        for i, (ar, got) in enumerate(zip(ids_t0["ar"], outs)):
            k = first_diff(ar, got)
            if k is None or k >= min(len(ar), len(got)):
                continue
            ctx = eng.encode(prompts[i]) + ar[:k]
            cache = model.new_cache(1, len(ctx) + 1, 256)
            hidden, _ = prefill(model, cache, torch.tensor(ctx, dtype=torch.long, device=model.device))
            logits = model.logits(hidden[None])[0].double()  # [v]
            top2 = logits.topk(2)
            rows.append({"mode": mode, "prompt": i, "position": k, "ar_token": ar[k], "run_token": got[k],
                         "logit_ar_token": round(float(logits[ar[k]]), 5),
                         "logit_run_token": round(float(logits[got[k]]), 5),
                         "top2_gap": round(float(top2.values[0] - top2.values[1]), 5),
                         "argmax": int(top2.indices[0])})
    eng.close()
    return rows
