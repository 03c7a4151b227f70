"""`kdtree bench --rank-only`: one TP rank of a model at its true size, measured alone on one GPU.

What runs: rank R's shard of the target with the preset's DFlash drafter (sharded over the group like
the target, and replicated, both timed), either drawn with random weights straight into GPU memory
(runtime/load/synthetic.py: the full-depth K2.6 rank does not fit the machine's disk) or read from a
synthetic artifact, under SoloRankComm (runtime/parallel/solo.py: the collectives have no peers and
cost nothing here).

Measured, with CUDA graphs (each piece captured alone and replayed `iters` times between CUDA events),
at each cache length L (the caches primed as after L committed tokens: random latent rows):
  - the AR step and a DDTree round at each budget B (the whole captured step of runtime/decode/round.py),
  - T(N): the target's verify forward + posterior over N = B + 1 tokens (N = 1: the AR forward),
  - the drafter (sharded and replicated), tree_build at B, tree_accept, kv_commit,
  - memory: weights, caches, workspaces, the graph pool, the peak; the draw (or load) time;
  - a profile of one replayed AR step and one DDTree round (torch.profiler / CUPTI: kernels inside the
    graph): per kernel class, count and µs, next to the roofline of the bytes it must read.
Modelled, not measured: the collectives (2 all-reduces per layer per forward, and the drafter's 1 + 2
per layer when sharded) at a stated latency per call, giving a TP8 tokens/s per user as a function of
tau.  Roofline bytes: every weight the forward reads once (the distinct routed experts counted from the
run's own routing), the committed cache rows, the lm_head; at this GPU's device-copy rate, measured at the start
of the run (an H100's rooflines at the H100's rate; before 2026-12-06 every sm_90 run used the H200's 4.25 TB/s).
Roofline flops (since 2026-12-07): every weight matrix times each token, each token's top_k expert slots, the
attention over the committed rows; at the dense bf16 tensor rate (plugins/common/device.RATES).  Each class's
roofline is the longer of its bytes' and its flops' times (the attention over a long cache and the dense GEMMs of
the large budgets are compute-bound), a forward's the sum over the classes.
"""

from __future__ import annotations

import datetime as _dt
import re
import time
from pathlib import Path
from typing import Callable

import torch

from build_pipeline.synthetic import PRESETS, drafter_config
from core.plan import ParallelPlan
from core.provenance import git_commit
from plugins.common.device import copy_bytes_per_s, tensor_flops_per_s
from plugins.kv_commit import kv_commit
from plugins.moe_w4a16 import expert_dims
from plugins.moe_w4a16.reference import route_reference
from plugins.tree_accept import tree_accept
from plugins.tree_build import tree_build
from runtime.decode.clock import time_launches
from runtime.decode.graphs import CapturedStep, GraphPool
from runtime.decode.params import SpecConfig
from runtime.decode.round import pick
from runtime.decode.session import DecodeSession
from runtime.kernel_timeline import step_increments
from runtime.load.artifact import is_artifact, read_manifest, read_rank
from runtime.load.synthetic import draw_drafter, draw_models
from runtime.model import target as target_module
from runtime.model.moe import router_logits
from runtime.model.target import TargetModel
from runtime.model.weights import MoEWeights, tensors_of
from runtime.parallel.solo import SoloRankComm

BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (4096, 32768)
# Latency of one small all-reduce inside a graph on 8 NVLink GPUs, per call (an assumption, not measured
# here: no 8-GPU machine is lent).  ~10 us: a one-shot custom all-reduce (vLLM / TRT-LLM style) for
# <= 1 MB; ~25 us: NCCL's ring/tree for the same sizes.  Both curves are reported.
ALLREDUCE_US = (10.0, 25.0)
KERNEL_CLASSES = (  # (class, kernel-name pattern), first match wins
    ("attention", r"tree_verify_(mla|wgmma)"),
    ("layer_glue", r"^_(add_rms_norm|mla_q_absorb|mla_v_absorb|mla_rope_kv|silu_mul)_kernel"),  # plugins/layer_fusion
    ("moe_experts", r"^(gate_up_kernel|down_kernel|silu_mul_kernel|combine_kernel|combine_shared_kernel|"
                    r"kdtree_moe_v3_)"),
    ("moe_route", r"route_kernel"),
    ("tree_ops", r"_tree_kernel|_lse_partial|_radix_pass|_gather_kernel|_sort_rows|_tree_accept|kv_commit|"
                 r"_advance_lens|posterior|_round_emit"),
    ("gemm", r"gemm|gemv|skinny_wgmma|nvjet|cutlass|xmma|splitK|cublas|Kernel2|sm90"),
    ("other", r"."),  # elementwise, reductions, copies, cat, embedding
)


def run_rank_bench(source: str = "kimi-k2.6", tp: int = 8, rank: int = 0, layers: int | None = None, seed: int = 0,
                   contexts: tuple[int, ...] = CONTEXTS, budgets: tuple[int, ...] = BUDGETS, iters: int = 20,
                   profile_budget: int = 16, progress: bool = True) -> dict:
    """Every figure of the module doc, as one JSON-able dict.  source: a --synthetic preset (rank `rank`
    of a tp-way plan drawn in GPU memory) or an artifact folder (its plan; rank `rank` read from disk)."""
    dev = torch.device("cuda")
    copy_bytes_per_s(dev)  # the copy rate first, while its 1 GiB is free, and out of the peak below
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    target, drafter, replicated, preset = load_rank_models(source, tp, rank, layers, seed, dev, progress)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    mem = {"weights_target_gb": _gb(_target_bytes(target)), "weights_drafter_sharded_gb": _gb(_drafter_bytes(drafter)),
           "weights_drafter_replicated_gb": _gb(_drafter_bytes(replicated))}
    pool = GraphPool(dev)
    rows, profiles = [], {}
    for ctx in contexts:
        for spec in [SpecConfig("none", 1)] + [SpecConfig("ddtree", b) for b in budgets]:
            prof = ctx == contexts[0] and (spec.mode == "none" or spec.budget == profile_budget)
            row = measure_mode(target, drafter, replicated, spec, ctx, iters, pool, prof)
            if prof:
                profiles[row["mode"]] = row.pop("profile")
                if "drafter_profile" in row:
                    profiles["drafter"] = row.pop("drafter_profile")
            rows.append(row)
            torch.cuda.empty_cache()  # the session's caches are gone: give their memory back before the next
            if progress:
                print(f"L={ctx} {row['mode']}: step {row['step_us']:.0f} us, T(N) {row['verify_us']:.0f} us",
                      flush=True)
    mem.update(peak_gb=_gb(torch.cuda.max_memory_allocated()), reserved_gb=_gb(torch.cuda.memory_reserved()))
    cfg = target.cfg
    return {
        "benchmark": "k26-rank", "source": source, "preset": preset, "tp": target.plan.tp, "rank": rank,
        "layers": cfg.num_layers, "seed": seed,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters,
        "bandwidth_bytes_per_s": round(copy_bytes_per_s(dev), -9),
        "bandwidth_source": "this GPU's device copy (bytes read + written), measured in this run",
        "load_s": round(load_s, 1), "loaded_by": "drawn in GPU memory" if preset == source else "read_rank",
        "memory": mem, "rows": rows, "profiles": profiles,
        "collectives_model": _collectives_model(rows, cfg.num_layers, drafter),
        "notes": ["the rank runs alone (SoloRankComm): collectives cost nothing in the measured times",
                  "random weights: the drafter never agrees with the target, so tau is ~1 here; the per-round "
                  "costs do not depend on tau, the modelled tokens/s takes tau as a parameter"],
    }


def load_rank_models(source: str, tp: int, rank: int, layers: int | None, seed: int, dev: torch.device,
                     progress: bool):
    """(target, sharded drafter, replicated drafter, preset) of rank `rank`, under SoloRankComm."""
    if is_artifact(source):
        manifest = read_manifest(source)
        preset = manifest.get("options", {}).get("synthetic")
        if preset is None:
            raise ValueError(f"{source}: --rank-only reads synthetic artifacts (`kdtree build --synthetic`); "
                             f"a built checkpoint runs with `kdtree bench` on its own GPUs")
        if layers is not None:
            raise ValueError("--layers applies to a preset; an artifact has its own depth")
        plan = ParallelPlan.from_dict(manifest["plan"])
        comm = SoloRankComm(rank, plan.tp, dev)
        bundle = read_rank(source, rank, dev, torch.bfloat16)
        dcfg = drafter_config(preset, bundle.cfg.num_layers)
        target = TargetModel(bundle.cfg, bundle.weights, dcfg.target_layer_ids, comm, plan)
        seed = manifest["options"].get("seed", seed)
        drafter = draw_drafter(preset, target, seed)
    elif source in PRESETS:
        preset = source
        target, drafter = draw_models(preset, SoloRankComm(rank, tp, dev), layers, seed, progress=progress)
    else:
        raise ValueError(f"--rank-only: {source!r} is neither a synthetic artifact nor a preset "
                         f"({', '.join(PRESETS)})")
    return target, drafter, draw_drafter(preset, target, seed, shard=False), preset


def measure_mode(target, drafter, replicated, spec: SpecConfig, ctx: int, iters: int, pool: GraphPool,
                 profile: bool) -> dict:
    """One (cache length, mode) row: the whole step, and each piece, each in its own graph."""
    base = torch.cuda.memory_allocated()
    s, step, rewind = captured_step(target, drafter, spec, ctx, pool)
    row = {"context": ctx, "mode": "ar" if spec.mode == "none" else f"ddtree-{spec.budget}",
           "budget": s.budget, "tokens": s.n, "step_us": _time(step.launch, iters, rewind)}
    buf, cache = s.buf, s.cache
    rewind()
    step.launch()  # leaves a real tree (DDTree) in the buffers for the pieces below
    torch.cuda.synchronize()
    if spec.mode == "none":
        verify = lambda: pick(target, target.forward(buf.bonus[:, None], cache.lens[:, None].long(), cache,
                                                     s.one)[0][:, 0], True, buf)
    else:
        verify = lambda: pick(target, target.forward(buf.tokens, buf.positions, cache, buf.mask)[0], True, buf)
    row["verify_us"] = _time(CapturedStep(verify, pool, name="verify").launch, iters, rewind)
    row["experts_touched_per_layer"] = _experts_touched(target, s, spec.mode == "none")
    row["roofline_bytes"] = _forward_bytes(target, ctx, row["experts_touched_per_layer"])
    row["roofline_flops"] = _forward_flops(target, ctx, s.n)
    row["verify_roofline_us"] = round(sum(_roofline_us(target.device, row["roofline_bytes"][k],
                                                       row["roofline_flops"][k]) for k in row["roofline_bytes"]), 1)
    row["verify_roofline_frac"] = round(row["verify_roofline_us"] / row["verify_us"], 3)
    if spec.mode != "none":
        rewind()
        for name, d in (("drafter_us", drafter), ("drafter_replicated_us", replicated)):
            dcache = d.new_cache(1, s.dcache.k.shape[2]) if d is not drafter else s.dcache
            dcache.lens.fill_(ctx - 1)
            run = lambda d=d, c=dcache: d.draft(c, buf.ctx_feats, buf.accept_len, buf.bonus, buf.ctx_tokens)
            row[name] = _time(CapturedStep(run, pool, name=name).launch, iters, lambda c=dcache: c.lens.fill_(ctx - 1))
            del dcache
        logits = drafter.draft(s.dcache, buf.ctx_feats, buf.accept_len, buf.bonus, buf.ctx_tokens)  # [1, D, V]
        build = lambda: tree_build(logits, buf.bonus, cache.lens.long(), s.topk, buf.tokens, buf.parents,
                                   buf.depth, buf.positions, buf.mask, s.tree_ws)
        row["tree_build_us"] = _time(CapturedStep(build, pool, name="tree_build").launch, iters, rewind)
        hidden, feats = target.forward(buf.tokens, buf.positions, cache, buf.mask)
        chosen = pick(target, hidden, True, buf)  # [1, N]
        accept = lambda: tree_accept(chosen, buf.tokens, buf.parents, buf.accept_idx, buf.accept_len, buf.bonus)
        row["tree_accept_us"] = _time(CapturedStep(accept, pool, name="tree_accept").launch, iters, rewind)
        commit = lambda: kv_commit(cache.kv, cache.lens, cache.scratch, buf.accept_idx, buf.accept_len, feats,
                                   buf.ctx_feats)
        row["kv_commit_us"] = _time(CapturedStep(commit, pool, name="kv_commit").launch, iters, rewind)
        row["drafter_bytes"] = _drafter_bytes(drafter)
        row["drafter_roofline_us"] = round(1e6 * row["drafter_bytes"] / copy_bytes_per_s(target.device), 1)
    row["step_roofline_us"] = round(row["verify_roofline_us"] + row.get("drafter_roofline_us", 0.0), 1)
    row["step_roofline_frac"] = round(row["step_roofline_us"] / row["step_us"], 3)
    row["cache_gb"] = _gb(s.cache.kv.numel() * s.cache.kv.element_size())
    row["session_gb"] = _gb(torch.cuda.memory_allocated() - base)  # caches, buffers, workspaces; graphs' pool apart
    if profile:
        row["profile"] = _profile(step.launch, rewind, target, _step_work_by_class(row), target.cfg.num_layers)
        if spec.mode != "none":  # the (sharded) drafter alone: its share of the round, kernel by kernel
            run = lambda: drafter.draft(s.dcache, buf.ctx_feats, buf.accept_len, buf.bonus, buf.ctx_tokens)
            row["drafter_profile"] = _profile(CapturedStep(run, pool, name="drafter_profile").launch,
                                              lambda: s.dcache.lens.fill_(ctx - 1), target,
                                              {"gemm": (row["drafter_bytes"], 0)}, drafter.cfg.num_layers)
    return row


def captured_step(target, drafter, spec: SpecConfig, ctx: int, pool: GraphPool
                  ) -> tuple[DecodeSession, CapturedStep, Callable[[], None]]:
    """(a one-request session primed as after ctx committed tokens, its whole step captured in a graph, the rewind
    to ctx that a timed replay starts from)."""
    s = DecodeSession(target, drafter, spec, 1, ctx + 64 * 8 * 4, pool)
    prime_session(s, ctx)
    step = s.capture(True)
    return s, step, lambda: rewind_session(s, ctx)


def step_us(target, drafter, spec: SpecConfig, ctx: int, iters: int, pool: GraphPool) -> float:
    """µs per replay of the whole captured step (measure_mode's step_us alone)."""
    s, step, rewind = captured_step(target, drafter, spec, ctx, pool)
    return _time(step.launch, iters, rewind)


def prime_session(s: DecodeSession, ctx: int) -> None:
    """The session's caches and buffers as after `ctx` committed tokens of one request: random latent rows
    (the kv_a-normed latent and roped k_pe are O(1) per element), one pending context row for the drafter."""
    g = torch.Generator(device=s.target.device).manual_seed(ctx)
    s.cache.kv[:, :, :ctx].normal_(generator=g)
    if s.dcache is not None:
        s.dcache.k[:, :, :ctx].normal_(generator=g)
        s.dcache.v[:, :, :ctx].normal_(generator=g)
        s.buf.ctx_feats.normal_(generator=g)
        s.buf.ctx_tokens.random_(0, s.target.cfg.vocab_size, generator=g)
    buf = s.buf
    buf.bonus.random_(0, s.target.cfg.vocab_size, generator=g)
    buf.max_new.fill_(1 << 30)
    buf.stop_ids.fill_(-1)
    rewind_session(s, ctx)


def rewind_session(s: DecodeSession, ctx: int) -> None:
    """Back to `ctx` committed tokens, one live request (what a timed replay starts from)."""
    s.cache.lens.fill_(ctx)
    if s.dcache is not None:
        s.dcache.lens.fill_(ctx - 1)
    s.buf.accept_len.fill_(1)
    s.buf.live.fill_(1)
    s.buf.produced.zero_()


def _time(launch: Callable[[], None], iters: int, reset: Callable[[], None]) -> float:
    """µs per call of `launch` over `iters` back-to-back calls (one warm call first; reset before each batch)."""
    reset()
    launch()
    reset()
    return round(time_launches(launch, iters), 1)


def _step_work_by_class(row: dict) -> dict[str, tuple[int, int]]:
    """The roofline (bytes, flops) of a whole step's kernel classes (target; the drafter's bytes in gemm)."""
    b, f = row["roofline_bytes"], row["roofline_flops"]
    gemm = ("dense", "router", "lm_head")
    return {"moe_experts": (b["experts"], f["experts"]),
            "gemm": (sum(b[k] for k in gemm) + row.get("drafter_bytes", 0), sum(f[k] for k in gemm)),
            "attention": (b["cache"], f["cache"])}


def _roofline_us(device, nbytes: float, flops: float) -> float:
    """The floor of one class of work in µs: its bytes at the device's copy rate or its flops at the dense bf16
    tensor rate, whichever takes longer."""
    return 1e6 * max(nbytes / copy_bytes_per_s(device), flops / tensor_flops_per_s(device))


def _profile(launch: Callable[[], None], reset: Callable[[], None], target,
             work_by_class: dict[str, tuple[int, int]], layers: int) -> dict:
    """Kernels of one replay of a captured graph, by class: count, µs (the kernels' profiled durations, which
    under PDL include waiting for the predecessor), step_us (what they add to the step: runtime/kernel_timeline;
    these sum to span_us), idle_us (launch gaps inside step_us), and the roofline of the class's (bytes, flops)
    (work_by_class) against step_us; per layer over `layers`."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch()
        torch.cuda.synchronize()
    kernels = []  # (name, class, duration, start, end)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time <= 0:
            continue
        name = ev.name
        if name.startswith(("Memcpy", "Memset")) and "Kernel" not in name:
            cls = "copy"
        else:
            cls = next(c for c, pat in KERNEL_CLASSES if re.search(pat, name))
        kernels.append((name, cls, ev.device_time, ev.time_range.start, ev.time_range.end))
    added = step_increments([(k[3], k[4]) for k in kernels])
    classes: dict[str, dict] = {}
    top: dict[str, list] = {}
    for (name, cls, us, _, _), (step, idle) in zip(kernels, added):
        c = classes.setdefault(cls, {"kernels": 0, "us": 0.0, "step_us": 0.0, "idle_us": 0.0})
        t = top.setdefault(name[:80], [0, 0.0, 0.0])
        c["kernels"] += 1
        c["us"] += us
        c["step_us"] += step
        c["idle_us"] += idle
        t[0] += 1
        t[1] += us
        t[2] += step
    for cls, c in classes.items():
        for key in ("us", "step_us", "idle_us"):
            c[key] = round(c[key], 1)
        if cls in work_by_class:
            c["roofline_us"] = round(_roofline_us(target.device, *work_by_class[cls]), 1)
            c["roofline_frac"] = round(c["roofline_us"] / c["step_us"], 3) if c["step_us"] else None
    total = sum(c["kernels"] for c in classes.values())
    return {"classes": classes, "kernels": total, "kernels_per_layer": round(total / layers, 1),
            "gpu_us": round(sum(c["us"] for c in classes.values()), 1),
            "span_us": round(sum(a for a, _ in added), 1),
            "top_columns": ["kernel", "count", "us", "step_us"],
            "sequence_columns": ["kernel", "us", "step_us", "idle_us"],
            "sequence": _middle_kernels(kernels, added, SEQUENCE_KERNELS),
            "top": sorted(([n, k, round(us, 1), round(st, 1)] for n, (k, us, st) in top.items()),
                          key=lambda r: -r[3])[:40]}


SEQUENCE_KERNELS = 40  # a profile's run of consecutive kernels from the middle of the round: two or three layers


def _middle_kernels(kernels: list[tuple], added: list[tuple[float, float]], n: int) -> list[list]:
    """n consecutive kernels (in start order) from the middle of the round: name, duration, what it added to the
    round and the launch gap inside that (where the time goes kernel by kernel, which the per-name totals hide)."""
    order = sorted(range(len(kernels)), key=lambda i: kernels[i][3])
    mid = order[max(0, len(order) // 2 - n // 2):][:n]
    return [[kernels[i][0][:60], round(kernels[i][2], 1), round(added[i][0], 1), round(added[i][1], 1)] for i in mid]


def _experts_touched(target, s: DecodeSession, ar: bool) -> float:
    """Mean distinct routed experts per MoE layer over this forward's tokens, from the run's own routing
    (one eager forward with the router's choice recorded; not timed)."""
    seen: list[int] = []
    inner = target_module.moe_forward

    def record(cfg, w: MoEWeights, x, e_start=0, workspace=None):
        xt = x.reshape(-1, x.shape[-1])  # [t, d]
        logits = router_logits(xt, w.gate)  # [t, e]
        idx, _ = route_reference(logits, w.gate_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                 cfg.norm_topk_prob, cfg.routed_scaling_factor)
        seen.append(int(idx.unique().numel()))
        return inner(cfg, w, x, e_start, workspace)

    buf, cache = s.buf, s.cache
    target_module.moe_forward = record
    try:
        if ar:
            target.forward(buf.bonus[:, None], cache.lens[:, None].long(), cache, s.one)
        else:
            target.forward(buf.tokens, buf.positions, cache, buf.mask)
    finally:
        target_module.moe_forward = inner
    return round(sum(seen) / len(seen), 2) if seen else 0.0


def _forward_bytes(target, ctx: int, touched: float) -> dict[str, int]:
    """Bytes one verify forward must read at least: each weight once (routed experts: only the touched
    ones), the committed cache rows, the lm_head (this rank's vocabulary rows)."""
    cfg, w = target.cfg, target.w
    out = {"dense": 0, "router": 0, "experts": 0, "cache": 0, "lm_head": _nbytes(w.lm_head)}
    for lw in w.layers:
        out["dense"] += sum(_nbytes(t) for t in vars(lw.attn).values() if t is not None)
        out["dense"] += _nbytes(lw.attn_norm) + _nbytes(lw.mlp_norm)
        if isinstance(lw.mlp, MoEWeights):
            ex = lw.mlp.experts
            per_expert = sum(_nbytes(t) for t in (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale) if t is not None) / ex.count
            out["experts"] += int(per_expert * touched)
            out["router"] += _nbytes(lw.mlp.gate) + _nbytes(lw.mlp.gate_bias)
            if lw.mlp.shared is not None:
                out["dense"] += _nbytes(lw.mlp.shared.gate_up) + _nbytes(lw.mlp.shared.down)
        else:
            out["dense"] += _nbytes(lw.mlp.gate_up) + _nbytes(lw.mlp.down)
    out["cache"] = ctx * cfg.d_qk * 2 * cfg.num_layers  # bf16 latent rows of every layer
    return out


def _forward_flops(target, ctx: int, n: int) -> dict[str, int]:
    """Flops (2 a multiply-add) one verify forward of n tokens must do at least, in _forward_bytes' classes: every
    weight matrix times each token (the routed experts: each token's top_k slots, those of this rank's experts),
    and each token's attention over the ctx committed rows in the absorbed form (scores over d_qk, values over
    kv_lora_rank; the tree's own rows left out)."""
    cfg, w = target.cfg, target.w
    heads = target.plan.local_heads(cfg)
    out = {"dense": 0, "router": 0, "experts": 0, "cache": 0, "lm_head": 2 * n * w.lm_head.numel()}
    for lw in w.layers:
        out["dense"] += 2 * n * sum(t.numel() for t in vars(lw.attn).values() if t is not None and t.dim() >= 2)
        if isinstance(lw.mlp, MoEWeights):
            e_local, i = expert_dims(lw.mlp.experts.w13)
            slots = n * cfg.num_experts_per_tok * e_local / cfg.n_routed_experts  # of this rank's experts
            out["experts"] += int(2 * slots * 3 * cfg.hidden_size * i)
            out["router"] += 2 * n * lw.mlp.gate.numel()
            if lw.mlp.shared is not None:
                out["dense"] += 2 * n * (lw.mlp.shared.gate_up.numel() + lw.mlp.shared.down.numel())
        else:
            out["dense"] += 2 * n * (lw.mlp.gate_up.numel() + lw.mlp.down.numel())
    out["cache"] = 2 * n * heads * ctx * (cfg.d_qk + cfg.kv_lora_rank) * cfg.num_layers
    return out


def _collectives_model(rows: list[dict], layers: int, drafter) -> dict:
    """TP8 time per round and tokens/s per user, modelled: measured rank step + collectives at each assumed
    latency (2 per layer for the target's forward; the sharded drafter's 1 + 2 per layer), for tau 1..8."""
    drafter_calls = 1 + 2 * drafter.cfg.num_layers if drafter.shards > 1 else 0
    out = {"allreduce_us_assumed": list(ALLREDUCE_US), "calls_per_round_target": 2 * layers,
           "calls_per_round_drafter": drafter_calls, "curves": []}
    for r in rows:
        calls = 2 * layers + (drafter_calls if r["mode"] != "ar" else 0)
        for lat in ALLREDUCE_US:
            round_us = r["step_us"] + calls * lat
            taus = [1.0] if r["mode"] == "ar" else [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
            out["curves"].append({"context": r["context"], "mode": r["mode"], "allreduce_us": lat,
                                  "round_us": round(round_us, 1),
                                  "tokens_per_s": {str(t): round(1e6 * t / round_us, 1) for t in taus}})
    return out


def _target_bytes(target) -> int:
    seen, total = set(), 0
    for t in tensors_of(target.w):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += _nbytes(t)
    return total


def _drafter_bytes(drafter) -> int:
    return sum(_nbytes(t) for t in tensors_of(drafter.w))


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _gb(n: float) -> float:
    return round(n / 1e9, 3)


def format_rank_table(res: dict) -> str:
    """The one table: per (context, mode) the step, T(N) against its roofline, and the pieces."""
    head = (f"{'L':>6} {'mode':<11}{'step us':>9}{'T(N) us':>9}{'roof us':>9}{'frac':>6}{'experts':>8}"
            f"{'draft':>7}{'draftR':>8}{'build':>7}{'accept':>7}{'commit':>7}")
    lines = [head, "-" * len(head)]

    def f(v, fmt=".0f"):
        return format(v, fmt) if v is not None else "-"
    for r in res["rows"]:
        lines.append(f"{r['context']:>6} {r['mode']:<11}{f(r['step_us']):>9}{f(r['verify_us']):>9}"
                     f"{f(r['verify_roofline_us']):>9}{f(r['verify_roofline_frac'], '.2f'):>6}"
                     f"{f(r['experts_touched_per_layer'], '.1f'):>8}{f(r.get('drafter_us')):>7}"
                     f"{f(r.get('drafter_replicated_us')):>8}{f(r.get('tree_build_us')):>7}"
                     f"{f(r.get('tree_accept_us')):>7}{f(r.get('kv_commit_us')):>7}")
    m = res["memory"]
    lines.append(f"{res['gpu']}: {res['preset']} tp {res['tp']} rank {res['rank']}, {res['layers']} layers; "
                 f"weights {m['weights_target_gb']} GB + drafter {m['weights_drafter_sharded_gb']} GB sharded "
                 f"({m['weights_drafter_replicated_gb']} GB replicated); peak {m['peak_gb']} GB; "
                 f"{res['loaded_by']} in {res['load_s']} s")
    for mode, p in res["profiles"].items():
        parts = ", ".join(f"{c} {v['kernels']}k {v['step_us']:.0f}us" for c, v in sorted(p["classes"].items()))
        lines.append(f"profile {mode}: {p['kernels']} kernels ({p['kernels_per_layer']}/layer), span "
                     f"{p['span_us']:.0f} us (durations {p['gpu_us']:.0f}); added to the step: {parts}")
    return "\n".join(lines)


def write_rank_result(res: dict, out_dir: str | Path) -> Path:
    import json

    path = Path(out_dir) / "k26-rank.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    return path


def bench_rank_cli(source: str, tp: int, rank: int, layers: int | None, contexts: str, budgets: str | None,
                   out: Path | None, as_json: bool) -> None:
    """`kdtree bench SOURCE --rank-only`: parse the flags, run, print the table (or JSON), write OUT/k26-rank.json."""
    import json

    if not torch.cuda.is_available():
        raise ValueError("--rank-only needs a CUDA device (it measures one rank at its true size on a GPU)")
    ctx = _ints(contexts, "--contexts")
    bs = BUDGETS if budgets is None else _ints(budgets, "--budgets")
    res = run_rank_bench(source, tp, rank, layers, contexts=ctx, budgets=bs, progress=not as_json)
    if out is not None:
        res["written"] = str(write_rank_result(res, out))
    print(json.dumps(res) if as_json else format_rank_table(res))


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} must be integers >= 1, got {text!r}")
    return vals
