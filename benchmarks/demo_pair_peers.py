"""Our runtime against two transformers peers on the demo pair, same weights, same prompts (issue 19):

  ours        Engine (kernels + CUDA graphs on CUDA), DDTree at --budget
  hf-ddtree   a straightforward transformers-style loop of the published DDTree design, written here:
              transformers' DeepseekV3ForCausalLM (decompressed MLA, its DynamicCache) verifies the tree
              under a 4D tree mask; the DFlash drafter is training/drafter.py's plain-torch forward over
              the whole context each round; the per-depth top-k is copied to the host and the tree built
              by a Python heap (plugins/tree_build/reference.py); the walk runs on the CPU
  hf-generate transformers' greedy `generate` (AR)

All at T = 0.  Pass 1 (--check-dtype, fp32 by default) compares the three token streams (they must be
equal: exit 1 otherwise); pass 2 (--dtype, bf16 on CUDA) times them: decode tokens/s (prefill excluded),
tau, and ours / peer at equal tau.

    python benchmarks/demo_pair_peers.py --pair artifacts/demo-pair --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.measure import first_diff, heldout_prompts  # noqa: E402
from training.target import LayerTap  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")  # torch dtype names, as kdtree run's --dtype


def hf_target(folder: Path, device: str, dtype: torch.dtype):
    """transformers' DeepseekV3ForCausalLM holding the shipped function (INT4 experts dequantised)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from training.target import load_exported
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**cfg), attn_implementation="sdpa").float()
    return load_exported(model, folder).to(device, dtype).eval()


def hf_drafter(folder: Path, target_hidden: int, device: str, dtype: torch.dtype):
    """training/drafter.py's TrainableDrafter filled from the z-lab-format checkpoint (safetensors)."""
    from safetensors.torch import load_file

    from training.drafter import TrainableDrafter
    cfg = json.loads((folder / "config.json").read_text())
    d = TrainableDrafter(cfg, target_hidden, seed=0)
    stored = load_file(str(folder / "model.safetensors"))
    with torch.no_grad():
        for s in d.specs:
            d.w(s.key).copy_(stored[s.ckpt].float())
    return d.to(device, dtype).eval()


def keep_in_cache(cache, past: int, idx: torch.Tensor) -> None:
    """Keep the first `past` positions of every layer's cache plus the tree nodes idx [a] after them."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [1, h, past + N, e]
            setattr(layer, name, torch.cat([t[:, :, :past], t[:, :, past + idx]], dim=2))


@torch.no_grad()
def hf_ddtree(target, drafter, tap: LayerTap, ids: list[int], max_new: int, budget: int, eos: int | None
              ) -> tuple[list[int], int, float]:
    """(new ids, rounds, decode seconds) of the transformers-style DDTree loop, greedy."""
    from transformers import DynamicCache

    from plugins.common.bitmask import unpack_mask
    from plugins.tree_accept.reference import tree_accept_reference
    from plugins.tree_build.reference import build_from_topk_reference, topk_logprobs_reference
    dev, dtype = target.device, target.dtype
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    cache = DynamicCache()
    x = torch.tensor([ids], device=dev)
    out = target(input_ids=x, past_key_values=cache, use_cache=True)
    feats = tap.feats()  # [1, l, F] context features of the committed tokens
    bonus = int(out.logits[0, -1].argmax())
    seq, new, rounds = list(ids), [bonus], 0
    neg = torch.finfo(dtype).min
    torch.cuda.synchronize() if dev.type == "cuda" else None
    t0 = time.perf_counter()
    while len(new) < max_new and bonus != eos:
        past = len(seq)
        seq_t = torch.tensor([seq + [bonus]], device=dev)
        f = torch.cat([feats, feats.new_zeros(1, 1, feats.shape[-1])], 1)  # the bonus has no features yet
        logits = drafter(f, seq_t, torch.tensor([[past]], device=dev), embed, head)[:, 0]  # [1, D, V]
        lp, top = topk_logprobs_reference(logits.float().cpu(), min(budget, logits.shape[-1]))  # to the host
        tokens, parents, depth, _, bits = build_from_topk_reference(lp, top, budget, torch.tensor([bonus]),
                                                                    torch.tensor([past]))
        n = tokens.shape[1]
        anc = unpack_mask(bits[0], n)  # [N, N] node j sees its ancestors and itself
        mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=dev)
        mask[0, 0, :, past:] = torch.where(anc, 0.0, neg).to(dev, dtype)
        out = target(input_ids=tokens.to(dev), position_ids=(past + depth).to(dev), attention_mask=mask,
                     past_key_values=cache, use_cache=True)
        post = out.logits[0].argmax(-1).cpu()[None]  # [1, N] the target's choice after each node
        a_idx = torch.zeros(1, int(depth.max()) + 1, dtype=torch.int32)
        a_len, nb = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
        tree_accept_reference(post, tokens, parents, a_idx, a_len, nb)  # the walk, on the CPU
        acc = a_idx[0, :int(a_len[0])].to(dev).long()
        keep_in_cache(cache, past, acc)
        feats = torch.cat([feats, tap.feats()[:, acc]], 1)
        got = tokens[0, acc.cpu()].tolist()  # the bonus first, then the accepted drafts
        seq += got
        new += got[1:] + [int(nb[0])]
        bonus = int(nb[0])
        rounds += 1
    torch.cuda.synchronize() if dev.type == "cuda" else None
    new = new[:max_new]
    if eos in new:
        new = new[:new.index(eos) + 1]
    return new, rounds, time.perf_counter() - t0


@torch.no_grad()
def hf_generate(target, ids: list[int], max_new: int, eos: int | None) -> tuple[list[int], float]:
    """(new ids, decode seconds: generate of max_new minus generate of 1) of transformers' greedy generate."""
    x = torch.tensor([ids], device=target.device)

    def run(n: int):
        sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        y = target.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos or 0)
        sync()
        return y[0, len(ids):].tolist(), time.perf_counter() - t0
    _, t1 = run(1)
    out, tn = run(max_new)
    return out, max(tn - t1, 1e-9)


def run_all(pair: Path, prompts: list[str], budget: int, max_new: int, device: str, dtype: torch.dtype) -> dict:
    from runtime.engine.engine import Engine
    eng = Engine.load(pair / "target", device=device, drafter=pair / "drafter", spec="ddtree", budget=budget,
                      dtype=dtype)
    ar_eng = eng.configure(spec="none")
    target = hf_target(pair / "target", device, dtype)
    layer_ids = json.loads((pair / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    drafter = hf_drafter(pair / "drafter", target.config.hidden_size, device, dtype)
    tap = LayerTap(target, layer_ids)
    eos = target.config.eos_token_id
    res = {k: {"ids": [], "new": 0, "rounds": 0, "decode_s": 0.0} for k in ("ours", "ours-ar", "hf-ddtree",
                                                                              "hf-generate")}
    enc = [eng.encode(p) for p in prompts]
    for warm in (True, False):
        for ids in (enc[:1] if warm else enc):
            for name in res:
                if name in ("ours", "ours-ar"):
                    e = eng if name == "ours" else ar_eng
                    out = list(e.generate_ids(ids, max_new_tokens=max_new))
                    st = e.last_stats
                    rounds, secs = st["rounds"], st["decode_s"]
                elif name == "hf-ddtree":
                    out, rounds, secs = hf_ddtree(target, drafter, tap, ids, max_new, budget, eos)
                else:
                    out, secs = hf_generate(target, ids, max_new, eos)
                    rounds = len(out)
                if not warm:
                    r = res[name]
                    r["ids"].append(out)
                    r["new"] += len(out)
                    r["rounds"] += rounds
                    r["decode_s"] += secs
    eng.close()
    rows = []
    for name, r in res.items():
        rows.append({"impl": name, "budget": budget if "ddtree" in name or name == "ours" else None,
                     "tau": round(r["new"] / r["rounds"], 4), "decode_tokens_per_s": round(r["new"] / r["decode_s"], 2),
                     "first_diff_vs_hf_generate": [first_diff(a, b) for a, b in zip(res["hf-generate"]["ids"],
                                                                                      r["ids"])]})
    return {"dtype": str(dtype).replace("torch.", ""), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=ROOT / "artifacts" / "demo-pair")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check-dtype", default="float32", choices=DTYPES)
    ap.add_argument("--dtype", default=None, choices=DTYPES, help="timing pass (bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo-pair-peers.json")
    args = ap.parse_args(argv)
    from benchmarks.common import git_commit, gpu_name
    prompts = heldout_prompts(args.pair / "corpus", args.prompts)
    timing = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    check = run_all(args.pair, prompts, args.budget, args.max_new_tokens, args.device,
                    getattr(torch, args.check_dtype))
    passes = [check] + ([] if timing == args.check_dtype else
                        [run_all(args.pair, prompts, args.budget, args.max_new_tokens, args.device,
                                 getattr(torch, timing))])
    ours = {p["dtype"]: next(r for r in p["rows"] if r["impl"] == "ours") for p in passes}
    for p in passes:
        for r in p["rows"]:
            r["ours_speedup"] = round(ours[p["dtype"]]["decode_tokens_per_s"] / r["decode_tokens_per_s"], 3)
    identical = all(all(d is None for d in r["first_diff_vs_hf_generate"]) for r in check["rows"])
    doc = {"benchmark": "demo-pair-peers", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git_commit": git_commit(), "gpu": gpu_name(), "device": args.device, "pair": str(args.pair),
           "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": 0,
           "identical_in_check_pass": identical, "passes": passes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'dtype':<9} {'impl':<12} {'tau':>6} {'tok/s':>9} {'ours x':>7}  first_diff vs hf-generate")
    for p in passes:
        for r in p["rows"]:
            print(f"{p['dtype']:<9} {r['impl']:<12} {r['tau']:>6.2f} {r['decode_tokens_per_s']:>9.1f} "
                  f"{r['ours_speedup']:>7.2f}  {r['first_diff_vs_hf_generate']}")
    print(f"wrote {args.out}")
    if not identical:
        print(f"NOT IDENTICAL in the {check['dtype']} pass", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
