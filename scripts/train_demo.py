"""Train the bundled demo pair (issue 19): a small Kimi-K2-architecture target and its DFlash drafter.

    .venv/bin/python scripts/train_demo.py --out /tmp/demo-pair --device cuda            # the shipped recipe
    .venv/bin/python scripts/train_demo.py --out /tmp/demo-pair --device cuda            # again: resumes
    .venv/bin/python scripts/train_demo.py --out /tmp/cpu-try --steps 300 --batch 8 --seq-len 256   # CPU try

Recipe (training/recipe.py DEMO; every size can be overridden by a flag):
- Corpus: the `.py` files of this interpreter's standard library (PSF-2.0), deduplicated by the hash
  of the normalised text, in path order; held out for evaluation: bisect, colorsys, csv, fnmatch,
  fractions, glob, graphlib, heapq, json, shlex, statistics, textwrap and their tests
  (training/corpus.py).  CPython 3.11: 1693 train files (30.9 M chars, ~9.3 M tokens), 46 held out.
- Tokenizer: byte-level BPE (`tokenizers`), 8192 ids: 8182 BPE ranks, then [BOS] [EOS] <|im_end|>
  <|im_user|> <|im_assistant|> <|im_system|> <|im_middle|> [UNK] [PAD] [MASK].
- Target (transformers' DeepseekV3ForCausalLM = the Kimi K2 architecture): hidden 256, 6 layers (layer 0
  dense, intermediate 768; layers 1-5 MoE: 16 routed experts of 256, top-4, 1 shared expert, sigmoid
  router with e_score_correction_bias kept balanced without aux loss, routed scale 2.827), 4 heads,
  MLA q_lora 128 / kv_lora 64 / nope 32 / rope 32 / v 32, YaRN factor 8 over 512 (context 4096),
  untied head.  AdamW (0.9, 0.95), wd 0.1, lr 3e-3, 200 warm-up steps then cosine to 10 %, grad
  clip 1.0, batch 32 x 512 tokens, bf16 autocast on CUDA.  Shipped: bf16, routed experts INT4
  (compressed-tensors pack-quantized, group 32): ~22 MB.
- Drafter (DFlash, z-lab's format): 3 Qwen3-style layers, hidden 256, 4 q / 2 kv heads of 64, MLP 768,
  block 8, features of target layers [1, 2, 3], mask token [MASK]; trained on the features of the
  target *as shipped* (INT4) with 32 random anchors per 512-token sequence, masked block, loss weights
  exp(-(t-1)/4); lr 2e-3, same schedule: ~5 MB bf16.
- Default steps: target 4500, drafter 3000 (--steps, --drafter-steps); seed 0.  On the H200: 93 ms per
  target step, 58 ms per drafter step (benchmarks/train_demo_device.sh runs each phase in one device call).

Outputs under --out (training/pipeline.py): target/ and drafter/ (load with
`Engine.load(out/"target", drafter=out/"drafter")`), loss.jsonl, loss.png, report.json (held-out loss
before / after INT4, the drafter's per-depth accuracy, tau on held-out prompts), ckpt/ for resuming.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.pipeline import train_demo
from training.recipe import DEMO


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=4500, help="target optimisation steps")
    ap.add_argument("--drafter-steps", type=int, default=3000, help="drafter optimisation steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--no-measure", action="store_true", help="skip the tau measurement at the end")
    ap.add_argument("--stop-after", choices=["target"], default=None,
                    help="stop once the target is exported (a later run trains the drafter on the export)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    recipe = DEMO.with_(batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup)
    recipe.check_budget()
    report = train_demo(args.out, recipe, args.steps, args.drafter_steps, args.device,
                        args.seed, args.ckpt_every, args.eval_every, measure=not args.no_measure,
                        stop_at_phase=args.stop_after)
    print(json.dumps({k: report.get(k) for k in ("target", "drafter")}, indent=2))
    for row in report.get("measure", {}).get("runs", []):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
