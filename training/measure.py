"""tau and speed of a (target, drafter) pair through the real Engine, on held-out prompts.

Modes: AR (spec none), the DFlash chain, DDTree at each budget; temperatures as given.  At T = 0 every
speculative mode must give exactly the AR tokens (lossless): `identical_to_ar` records it.  Speedup is
decode tokens/s over AR's at the same temperature on the same device.
"""

from __future__ import annotations

import time
from pathlib import Path

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
                 chain: bool = True, seed: int = 0) -> dict:
    from runtime.engine.engine import Engine

    eng = Engine.load(target_dir, device=device, drafter=drafter_dir, spec="ddtree", budget=budgets[0])
    modes = [("ar", "none", 0)] + ([("chain", "chain", 0)] if chain else []) + [
        (f"ddtree-{b}", "ddtree", b) for b in budgets]
    results = {"target": str(target_dir), "drafter": str(drafter_dir), "device": device, "prompts": len(prompts),
               "max_new_tokens": max_new_tokens, "runs": []}
    for temp in temperatures:
        ar_ids: list[list[int]] = []
        ar_tps = None
        for label, spec, budget in modes:
            e = eng.configure(spec=spec, budget=budget or eng.budget)
            list(e.generate_ids(prompts[0], max_new_tokens=8, temperature=temp, seed=seed))  # warm the session
            new = rounds = 0
            decode_s = 0.0
            outs = []
            t0 = time.monotonic()
            for i, p in enumerate(prompts):
                ids = list(e.generate_ids(p, max_new_tokens=max_new_tokens, temperature=temp, seed=seed + i))
                st = e.last_stats
                outs.append(ids)
                new += st["new_tokens"]
                rounds += st["rounds"]
                decode_s += st["decode_s"]
            wall = time.monotonic() - t0
            tps = new / decode_s if decode_s > 0 else None
            row = {"mode": label, "temperature": temp, "budget": budget or None, "new_tokens": new,
                   "rounds": rounds, "tau": round(new / rounds, 4) if rounds else None,
                   "decode_tokens_per_s": round(tps, 2) if tps else None, "wall_s": round(wall, 3)}
            if spec == "none":
                ar_ids, ar_tps = outs, tps
            else:
                row["speedup_vs_ar"] = round(tps / ar_tps, 3) if tps and ar_tps else None
                if temp == 0:
                    row["identical_to_ar"] = outs == ar_ids
            results["runs"].append(row)
    eng.close()
    return results
