"""Subprocess of `kdtree build --warm` (build_pipeline/kernel_cache.warm): decode an artifact on CUDA in one
mode over the warm-up prompts, so that Triton compiles every kernel variant that mode launches into
TRITON_CACHE_DIR (set by the caller); with budget auto the session also measures its cost curve and stores it in
ART/autotune/.  Graphs on and the runtime's default dtype, as `kdtree run`."""

from __future__ import annotations

import argparse

import torch

from build_pipeline.kernel_cache import NEW_TOKENS, PROMPT_LENGTHS, SAMPLED_LENGTHS, SAMPLED_T
from runtime.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--art", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--budget", required=True, help="an integer, or auto (every bucket; stores the cost curve)")
    a = ap.parse_args()
    eng = Engine.load(a.art, device="cuda", spec=a.spec, budget=a.budget, graphs=True)  # "16" or "auto" (parse_budget)
    gen = torch.Generator().manual_seed(0)
    for n in PROMPT_LENGTHS:
        ids = torch.randint(0, eng.cfg.vocab_size, (n,), generator=gen).tolist()
        list(eng.generate_ids(ids, NEW_TOKENS, 0.0, seed=0))
        if n in SAMPLED_LENGTHS:
            list(eng.generate_ids(ids, NEW_TOKENS, SAMPLED_T, seed=0))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
