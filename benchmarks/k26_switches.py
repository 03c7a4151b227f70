"""A/B of the runtime's performance switches on one K2.6 TP8 rank, loaded once (the load is most of a rank
benchmark's time): for each setting the AR step and DDTree rounds at one cache length and the given budgets, each
captured afresh after the switches are set (runtime/bench_rank.measure_mode; with --profile also each mode's kernels
per layer and per kernel class what it adds to the step).

Switches (each off unless named in a setting, whatever its default; "base" names none, "default" those on by
default (DEFAULT_ON), which are set again after the run):
  skinny    KDTREE_SKINNY_GEMM (on by default): one-token GEMMs on plugins/skinny_gemm (runtime.model.layers)
  skinny_wide with skinny: every GEMM of up to 32 tokens and 128 MB (layers.SKINNY_MAX_TOKENS / _WEIGHT_BYTES)
  skinny_tree with skinny: GEMMs of up to 24 tokens (a DDTree-16 round's 17) within the default weight limit
            (the attention's, the router's and the shared expert's: skinny_gemm's two row groups and three tiles)
  skinny_8  with skinny: GEMMs of up to 8 tokens (one token tile: the one-token kernel, the same sums per token;
            DDTree rounds of budget <= 7, the drafter's block of 8) within the default weight limit (H100, 40 layers,
            k26-switches-h100.json call 6: DDTree-1 -2.5 %, DDTree-4 -0.4 %, DDTree-7 / 16 level, the drafter
            +2.4 %: left off)
  moe_pf    KDTREE_MOE_PREFETCH=1: the MoE's L2 prefetch of its experts at every t (not named: off)
  gemm_pf   KDTREE_GEMM_PREFETCH: each layer's post-attention weights into L2 before its attention
  attn_pf   KDTREE_ATTN_PREFETCH: the attention's first cache tiles into L2 before its PDL wait
  skinny_late with skinny: the next kernel launches after the GEMM's k loops (plugins/skinny_gemm/launch.LATE_TRIGGER)
  skinny_pf with skinny: every GEMM CTA's weights into L2 before its PDL wait (not named: launch.PREFETCH's default,
            the plans that split k only)
  skinny_frag with skinny: the one-token GEMMs read fragment-order copies of their weights (512-byte warp loads;
            runtime.model.layers.FRAG_WEIGHTS, plugins/skinny_gemm/fragment_order.py; the same bits)
  skinny_early with skinny: each warp's first weights before the PDL wait (skinny_gemm/launch.EARLY_WEIGHTS; default)
  moe_w16   the MoE's 16-warp gate_up where it applies (plugins/moe_w4a16/launch_v3.USE_W16)
  moe_early the MoE's down kernel loads its weights before its PDL wait (launch_v3.EARLY_WEIGHTS; on by default)
  moe_one   the 16-warp gate_up at t = 1 takes token 0 without reading the lists first (launch_v3.ONE_TOKEN)
  moe_one_launch at t = 1 the MoE's gate_up and down in one grid (launch_v3.ONE_LAUNCH, moe_v3.cu's kdtree_moe_v3_one)
  moe_one_shared with moe_one_launch: that grid also forms the shared expert's down product, the combine adds it
            (launch_v3.ONE_SHARED; on by default, inert without moe_one_launch)
  moe_one_combine with moe_one_launch: that grid also sums the rows into y, no combine launch (launch_v3.ONE_COMBINE)
  skinny_wgmma GEMMs of 2..32 tokens (DDTree rounds, the drafter's block) on skinny_wgmma.cu, sm_90
            (runtime.model.layers.SKINNY_WGMMA; on by default: DDTree-16 -1.8 % at 4K, call 12)
  wgmma_kb4 with skinny_wgmma: four 64-column boxes a TMA stage (512 contiguous bytes of each weight row at once,
            4 stages; plugins/skinny_gemm/wgmma_launch.KB4; DDTree-16 +0.9 % at 4K, call 13: off)
  wgmma_t1  with skinny_wgmma: one-token GEMMs (the AR step's) on skinny_wgmma.cu too, not skinny_gemm.cu
            (runtime.model.layers.WGMMA_TOKENS from 1)
  absorb_tree the attention's W_UV product in 16-wide value blocks up to 32 tokens (DDTree rounds), not 16
            (plugins/layer_fusion/kernel.V_ABSORB_TREE; on by default: DDTree-16 -1.0 % at 4K, call 13)
  route_stores the MoE routing of one token writes its counts and lists by stores, not atomics
            (route_kernel.ONE_TOKEN_STORES; on by default: AR -0.85 %, call 12)
  glue_early the attention's two absorb kernels load their W_UK / W_UV tile before the PDL wait
            (plugins/layer_fusion/kernel.EARLY_WEIGHTS)
  attn_long the attention's 64-key tiles, 3 stages, one program per SM for an AR step over a 16K-64K cache
            (plugins/tree_verify_mla/launcher.LONG_TILE; on by default)
  attn_wgmma the attention of 33..1024 query rows (DDTree rounds) on the wgmma split kernel, sm_90
            (plugins/tree_verify_mla/launcher.WGMMA, tree_verify_wgmma.cu; on by default: DDTree-16 -12.5 % at 32K,
            level at 4K, k26-switches-h100.json calls 8-10)
  attn_early with attn_wgmma: a split's first committed key tile in flight by TMA before its PDL wait
            (plugins/tree_verify_mla/wgmma_launch.EARLY)
  attn_wgmma_ar with attn_wgmma: 1..32 query rows (the AR step) on the wgmma split kernel too (launcher.WGMMA_AR)
  attn_early2 with attn_early: the second stage's committed tile before the wait too (wgmma_launch.EARLY2)
  attn_wgmma_wide with attn_wgmma: more than 1024 query rows too (budgets 128 / 256; launcher.WGMMA_WIDE)

    python3 benchmarks/k26_switches.py --out DIR [--settings base,skinny,moe_pf,gemm_pf,attn_pf,...]
        [--context 4096] [--budget 16[,15,...]] [--iters 10] [--layers N] [--source tiny-kimi --tp 1 --context 512]
Writes OUT/k26-switches.json; prints a table with each setting's change against the first.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_rank_arguments, parse_combinations, print_table, write_result  # noqa: E402


def _set_skinny_wide(on: bool) -> None:
    from plugins.skinny_gemm import launch
    from runtime.model import layers
    layers.SKINNY_MAX_TOKENS, layers.SKINNY_MAX_WEIGHT_BYTES = (launch.MAX_TOKENS, launch.MAX_WEIGHT_BYTES) if on \
        else layers.SKINNY_LIMITS


def _set_wgmma_t1(on: bool) -> None:
    from runtime.model import layers
    layers.WGMMA_TOKENS = (1 if on else 2, layers.WGMMA_TOKENS[1])


def _widen_skinny_tokens(tokens: int):
    """A switch that, on, lets skinny GEMMs take up to `tokens` tokens; applied after skinny_wide (SWITCHES' order),
    which resets the limits: it only ever widens."""
    def setter(on: bool) -> None:
        from runtime.model import layers
        if on:
            layers.SKINNY_MAX_TOKENS = max(layers.SKINNY_MAX_TOKENS, tokens)
    return setter


def _set_moe_pf(on: bool) -> None:
    if on:
        os.environ["KDTREE_MOE_PREFETCH"] = "1"
    else:  # the default: off
        os.environ.pop("KDTREE_MOE_PREFETCH", None)


def _set_skinny_pf(on: bool) -> None:
    from plugins.skinny_gemm import launch
    launch.PREFETCH = True if on else None


def _set_flag(module: str, attr: str):
    """A switch that sets one module attribute (read at each launch or forward) to its on / off."""
    return lambda on: setattr(importlib.import_module(module), attr, on)


# switch -> (module, attribute) it sets to on / off
_FLAGS = {"skinny": ("runtime.model.layers", "SKINNY_GEMM"),
          "gemm_pf": ("runtime.model.attention", "GEMM_PREFETCH"),
          "attn_pf": ("plugins.tree_verify_mla.launcher", "CACHE_PREFETCH"),
          "skinny_late": ("plugins.skinny_gemm.launch", "LATE_TRIGGER"),
          "skinny_early": ("plugins.skinny_gemm.launch", "EARLY_WEIGHTS"),
          "skinny_frag": ("runtime.model.layers", "FRAG_WEIGHTS"),
          "moe_w16": ("plugins.moe_w4a16.launch_v3", "USE_W16"),
          "moe_early": ("plugins.moe_w4a16.launch_v3", "EARLY_WEIGHTS"),
          "moe_one": ("plugins.moe_w4a16.launch_v3", "ONE_TOKEN"),
          "moe_one_launch": ("plugins.moe_w4a16.launch_v3", "ONE_LAUNCH"),
          "moe_one_shared": ("plugins.moe_w4a16.launch_v3", "ONE_SHARED"),
          "moe_one_combine": ("plugins.moe_w4a16.launch_v3", "ONE_COMBINE"),
          "route_stores": ("plugins.moe_w4a16.route_kernel", "ONE_TOKEN_STORES"),
          "skinny_wgmma": ("runtime.model.layers", "SKINNY_WGMMA"),
          "wgmma_kb4": ("plugins.skinny_gemm.wgmma_launch", "KB4"),
          "absorb_tree": ("plugins.layer_fusion.kernel", "V_ABSORB_TREE"),
          "glue_early": ("plugins.layer_fusion.kernel", "EARLY_WEIGHTS"),
          "attn_long": ("plugins.tree_verify_mla.launcher", "LONG_TILE"),
          "attn_wgmma": ("plugins.tree_verify_mla.launcher", "WGMMA"),
          "attn_early": ("plugins.tree_verify_mla.wgmma_launch", "EARLY"),
          "attn_wgmma_ar": ("plugins.tree_verify_mla.launcher", "WGMMA_AR"),
          "attn_early2": ("plugins.tree_verify_mla.wgmma_launch", "EARLY2"),
          "attn_wgmma_wide": ("plugins.tree_verify_mla.launcher", "WGMMA_WIDE")}
# see the module doc; skinny_wide before skinny_tree and skinny_8 (which widen only what skinny_wide left)
SWITCHES = {"moe_pf": _set_moe_pf, "skinny_pf": _set_skinny_pf,
            "skinny_wide": _set_skinny_wide, "skinny_tree": _widen_skinny_tokens(24),
            "skinny_8": _widen_skinny_tokens(8), "wgmma_t1": _set_wgmma_t1,
            **{name: _set_flag(*at) for name, at in _FLAGS.items()}}


# the runtime's defaults among SWITCHES
DEFAULT_ON = frozenset({"skinny", "moe_early", "skinny_early", "glue_early", "moe_w16", "attn_long", "attn_wgmma",
                        "skinny_wgmma", "route_stores", "absorb_tree", "attn_early", "attn_wgmma_ar",
                        "attn_early2", "attn_wgmma_wide", "moe_one", "moe_one_shared", "moe_one_launch"})


def parse_settings(text: str) -> list[tuple[str, frozenset[str]]]:
    """"base,skinny+moe_pf" -> [("base", {}), ("skinny+moe_pf", {"skinny", "moe_pf"})]; an unknown switch is a
    ValueError naming it and the known ones."""
    return parse_combinations(text, SWITCHES, "--settings", "switch", {"base": frozenset(), "default": DEFAULT_ON})


def apply(on: frozenset[str]) -> None:
    for name, set_switch in SWITCHES.items():
        set_switch(name in on)


def _write(rows: list[dict], a, budgets: list[int], layers: int):
    """OUT/k26-switches.json with each setting's change against the first (rows gain the _vs_ columns)."""
    base = rows[0]
    for row in rows:
        for key in [k for k in row if k.endswith("_us")]:
            row[f"{key[:-3]}_vs_{base['setting']}"] = round(row[key] / base[key], 3)
    extra = {"source": a.source, "tp": a.tp, "layers": layers, "context": a.context, "budgets": budgets,
             "iters": a.iters, "switches": __doc__.split("Switches")[1].split("\n\n")[0].strip(),
             "timing": "runtime/bench_rank.measure_mode: CUDA graphs, each setting captured afresh"}
    return write_result("k26-switches", rows, extra, a.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(ap)
    ap.add_argument("--settings", default="base,skinny,skinny+skinny_wide,skinny+skinny_pf,moe_pf,gemm_pf,attn_pf,"
                                          "skinny+skinny_pf+moe_pf+attn_pf")
    ap.add_argument("--budget", default="16", help="DDTree budgets, comma-separated (15,16: T(16) against T(17), "
                    "whether buckets of 2^k - 1 nodes save the padding of 2^k + 1 tokens)")
    ap.add_argument("--profile", action="store_true", help="also one profiled replay per mode and setting: kernels "
                    "per layer and, per kernel class, its kernels and the µs it adds to the step (bench_rank's "
                    "profile, and its 12 kernels that add most to the step), so that a row shows where a switch acted")
    a = ap.parse_args()
    settings = parse_settings(a.settings)
    budgets = [int(b) for b in a.budget.split(",")]

    import torch

    from runtime.bench_rank import load_rank_models, measure_mode
    from runtime.decode.graphs import GraphPool
    from runtime.decode.params import SpecConfig

    dev = torch.device("cuda")
    target, drafter, replicated, _ = load_rank_models(a.source, a.tp, 0, a.layers, 0, dev, True)
    pool = GraphPool(dev)
    rows = []
    for name, on in settings:
        apply(on)
        row = {"setting": name}
        for spec in (SpecConfig("none", 1), *(SpecConfig("ddtree", b) for b in budgets)):
            r = measure_mode(target, drafter, replicated, spec, a.context, a.iters, pool, a.profile)
            key = "ar" if spec.mode == "none" else f"ddtree{spec.budget}"
            row[f"{key}_step_us"], row[f"{key}_verify_us"] = r["step_us"], r["verify_us"]
            if "profile" in r:
                prof = r["profile"]
                row[f"{key}_kernels_per_layer"] = prof["kernels_per_layer"]
                row[f"{key}_classes"] = {c: {"kernels": v["kernels"], "step_us": v["step_us"]}
                                         for c, v in prof["classes"].items()}
                # the kernels that add most to the step ([kernel, count, µs, step µs]): which kernel a switch moved
                row[f"{key}_top"] = prof["top"][:12]
            if "drafter_us" in r:
                row[f"{key}_drafter_us"] = r["drafter_us"]
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
        path = _write(rows, a, budgets, target.cfg.num_layers)  # after every setting: a run cut short keeps its rows
    apply(DEFAULT_ON)
    print(f"wrote {path}")
    base = rows[0]
    cols = ["setting", "ar_step_us", "ar_verify_us", f"ar_step_vs_{base['setting']}"]
    for b in budgets:
        cols += [f"ddtree{b}_step_us", f"ddtree{b}_verify_us", f"ddtree{b}_step_vs_{base['setting']}"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
