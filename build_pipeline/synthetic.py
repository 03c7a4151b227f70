"""`kdtree build --synthetic PRESET --tp T --rank R [--layers N] --out ART`: one rank of a model with random
weights, made without a checkpoint, in exactly the layout `kdtree build` writes (build_pipeline/shard.py's
file names, tensor names, shapes and stored dtypes; the same manifest keys), so runtime/load/artifact.read_rank
and load_models read it unchanged.

Only rank R's cut is drawn (h/tp heads, intermediate/tp expert and MLP slices, v/tp vocab rows) and each
layer file is written as soon as it is made: peak host memory is about one layer of one rank.  Every
(tensor, piece) has its own torch.Generator seeded by sha256(seed, stored name, piece), where piece is
the rank for cut tensors (and the expert for routed experts) and "all" for replicated ones; so any rank
and any layer is reproducible on its own, replicated tensors are equal on every rank, and the ranks of
one seed together form one consistent model.  Layer i is the same for every --layers N > i.

Init (why activations stay finite over 61 layers): every linear weight ~ N(0, 1/fan_in) with fan_in
the full (uncut) input width, so each projection keeps unit scale; the residual writers (attn.o, the
dense and shared MLP down, the routed experts' down) are scaled further by 1/sqrt(2 * L_preset), so
the residual stream (embed ~ N(0, 1)) grows by O(1) over the whole depth; norms are 1.  INT4 experts:
values uniform in [-8, 7] (uniform random words in fragment order, padding q = 0), per-group
scales s = +-u * base with u ~ U(0.5, 1.5) and a random sign (q's mean -0.5 would otherwise add one
coherent direction to every expert of every layer: measured, the residual grew to rms 8.6 over 61
layers with positive scales and stays <= 1.3 with signed ones), base chosen so the dequantised weight
has the std of its bf16 counterpart.  Router: gate ~ N(0, 1/d) (the sigmoid's logits ~ N(0, 1) on a
normed input: token-dependent routing, no saturation); e_score_correction_bias ~ N(0, 0.01) in fp32
(Kimi ships it fp32; the gate is bf16 as in the checkpoint).  lm_head ~ N(0, 1/d).

Output: --out only, never the cache: a K2.6 TP8 rank is ~76 GB and the device disk holds one copy, not a
cache entry plus a copy.  The manifest's `key` (sha256 over the config, plan, rank, layers, seed, code
version and toolchain) makes a repeated command with an intact --out a no-op.  The manifest lists only
rank R; no graphs, kernels, tokenizer (ids only) or drafter.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch

from build_pipeline import artifact_cache as cache
from build_pipeline.build import COLLECTIVES, LAYOUT, BuildResult, holds_key, refuse_foreign_out
from build_pipeline.kernel_cache import UNWARMED, not_warmed
from build_pipeline.shard import GLOBALS_FILE, layer_file, save_rank_file
from core.config import ModelConfig, parse_config
from core.errors import KdtreeError
from core.plan import ParallelPlan
from core.drafter_config import DrafterConfig, parse_drafter_config
from core.presets import KIMI_K26_CONFIG, KIMI_K26_DRAFTER
from core.progress import Progress
from plugins.moe_w4a16.layout import GROUP, padded_k

_TINY_TEXT = dict(  # build_pipeline/tiny.py's "kimi" preset widths in K2.6's structure (CPU tests)
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64,
    q_lora_rank=96, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, max_position_embeddings=4096,
    bos_token_id=768, eos_token_id=769, pad_token_id=776,  # tiny_tokenizer's specials
    rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def _with_text(base: dict, **text) -> dict:
    c = copy.deepcopy(base)
    c["text_config"].update(text)
    return c


PRESETS: dict[str, dict] = {
    "kimi-k2.6": KIMI_K26_CONFIG,  # the real config.json (kimi_k25, INT4 group-32 experts)
    "tiny-kimi": _with_text(KIMI_K26_CONFIG, **_TINY_TEXT),  # same structure, make-tiny widths
}

DRAFTERS: dict[str, dict] = {  # each preset's DFlash drafter geometry (z-lab's config.json form)
    "kimi-k2.6": KIMI_K26_DRAFTER,
    "tiny-kimi": {**KIMI_K26_DRAFTER, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "head_dim": 32, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 1024,
                  "dflash_config": {"block_size": 8, "mask_token_id": 1023, "target_layer_ids": [1, 2]}},
}

_Q_SQ = 21.5  # E[q^2], q uniform on the 16 integers [-8, 7] (variance 21.25, mean -0.5)
_U_SQ = 1.0 + 1.0 / 12.0  # E[u^2], u ~ U(0.5, 1.5)


def preset_config(preset: str, layers: int | None = None) -> tuple[ModelConfig, int]:
    """(config with `layers` layers, the preset's own depth)."""
    if preset not in PRESETS:
        raise KdtreeError(f"--synthetic {preset!r} is unknown (known: {', '.join(PRESETS)})")
    raw = PRESETS[preset]
    depth = raw["text_config"]["num_hidden_layers"]
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= depth:
            raise KdtreeError(f"--layers must lie in [1, {depth}] for --synthetic {preset}, got {layers!r}")
        raw = _with_text(raw, num_hidden_layers=layers)
    return parse_config(raw, source=f"--synthetic {preset}"), depth


def build_synthetic(preset: str, out: str | Path, tp: int = 8, rank: int = 0, layers: int | None = None,
                    seed: int = 0, progress: bool = True, force: bool = False, device: str = "cpu"):
    """Write rank `rank` of a `tp`-way plan of `preset` with random weights to `out` (see the module doc);
    returns build_pipeline.build.BuildResult (cache_hit: `out` already held this key, intact).
    device: where the weights are drawn ("cuda" is fast and gives other numbers than "cpu", see Draw)."""
    t0 = time.perf_counter()
    if out is None:
        raise KdtreeError("--synthetic needs --out ART (a synthetic rank is written to --out, not the cache)")
    out = Path(out)
    cfg, depth = preset_config(preset, layers)
    plan = ParallelPlan(tp=tp)
    plan.validate(cfg)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise KdtreeError(f"--rank {rank} is outside [0, {tp}) for --tp {tp}")
    if cfg.quant is not None and cfg.quant.kind == "int4" and cfg.quant.group_size != GROUP:
        raise KdtreeError(f"--synthetic {preset}: INT4 group_size {cfg.quant.group_size} is not the kernel's {GROUP}")
    options = {"tp": tp, "ep": False, "backend": "native", "archs": [], "budgets": [], "synthetic": preset,
               "seed": seed, "rank": rank, "layers": cfg.num_layers, "draw_device": torch.device(device).type}
    tools = cache.toolchain()
    key = cache.build_key({"synthetic/" + preset: cache.sha256_json(cfg.to_dict())}, options,
                          cache.code_version(), tools)
    if not force and holds_key(out, key):
        return BuildResult(out, True, json.loads((out / cache.MANIFEST).read_text()), time.perf_counter() - t0)
    refuse_foreign_out(out, force)
    shutil.rmtree(out, ignore_errors=True)  # replaced anyway: free its disk before writing the new one
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.stage-{key[:8]}-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        manifest = _write(stage, cfg, depth, plan, rank, seed, progress, device)
        manifest.update(format=cache.FORMAT, format_version=cache.FORMAT_VERSION, key=key, options=options,
                        toolchain=tools, inputs={}, budgets=[])
        with open(stage / cache.MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return BuildResult(out, False, manifest, time.perf_counter() - t0)


def rank_files(cfg: ModelConfig, depth: int, plan: ParallelPlan, rank: int, seed: int, device: str | torch.device
               ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(file name, {stored name: tensor on `device`}) of rank `rank`, one file at a time: the globals,
    then layer 0, 1, ...  The one source of a synthetic rank, whether written (build_synthetic) or
    drawn straight into memory (runtime/load/synthetic.py)."""
    draw = Draw(seed, rank, out_scale=(2 * depth) ** -0.5, device=device)
    yield GLOBALS_FILE, globals_tensors(cfg, plan, rank, draw)
    for i in range(cfg.num_layers):
        yield layer_file(i), layer_tensors(cfg, plan, rank, i, draw)


def _write(stage: Path, cfg: ModelConfig, depth: int, plan: ParallelPlan, rank: int, seed: int,
           progress: bool, device: str) -> dict:
    t = time.perf_counter()
    (stage / f"rank{rank}").mkdir(parents=True)
    files: dict[str, dict] = {}
    paths = []
    bar = Progress(cfg.num_layers + 1, "synthetic weights", enabled=progress)
    for name, tensors in rank_files(cfg, depth, plan, rank, seed, device):
        rel = f"rank{rank}/{name}"
        save_rank_file({k: t.cpu() for k, t in tensors.items()}, stage / rel, rank, plan.tp)
        del tensors
        # hashed right after writing, while the file is still in the page cache
        files[rel] = {"sha256": cache.sha256_file(stage / rel), "bytes": (stage / rel).stat().st_size}
        paths.append(rel)
        bar.advance()
    bar.close()
    return {
        "model": cfg.to_dict(), "plan": plan.to_dict(), "files": files,
        "steps_s": {"synthetic": time.perf_counter() - t},
        "ranks": {str(rank): {"files": [{"path": p, **files[p]} for p in paths], "graphs": [], "engines": [],
                              "vocab_range": list(plan.vocab_range(cfg, rank)),
                              "experts": list(plan.local_experts(cfg, rank)), "heads": plan.local_heads(cfg)}},
        "kernels": [], "triton_cache": not_warmed(UNWARMED), "drafter": None, "tokenizer": None,
        "synthetic": {"seed": seed, "rank": rank, "preset_layers": depth,
                      "init": "build_pipeline/synthetic.py (N(0, 1/fan_in), residual writers / sqrt(2 L))"},
        "layout": LAYOUT, "collectives": COLLECTIVES,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class Draw:
    """Seeded draws: one generator per (stored name, piece); piece = the rank for cut tensors.

    device: where the generators run and the tensors are made.  CPU and CUDA generators give different
    numbers for one seed (both deterministic): a rank drawn on "cuda" equals itself, not the CPU draw."""

    def __init__(self, seed: int, rank: int, out_scale: float, device: str | torch.device = "cpu"):
        self.seed, self.rank, self.out_scale, self.device = seed, rank, out_scale, torch.device(device)

    def gen(self, name: str, piece) -> torch.Generator:
        h = hashlib.sha256(f"{self.seed}/{name}/{piece}".encode()).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))

    def normal(self, name: str, shape, std: float, piece=None, dtype=torch.bfloat16) -> torch.Tensor:
        """N(0, std) of `shape`; piece: None for this rank's cut, "all" for a replicated tensor, (rank,
        expert) for one routed expert."""
        g = self.gen(name, self.rank if piece is None else piece)
        return (torch.randn(shape, generator=g, device=self.device) * std).to(dtype)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16, device=self.device)


def globals_tensors(cfg: ModelConfig, plan: ParallelPlan, rank: int, draw: Draw) -> dict[str, torch.Tensor]:
    """embed and lm_head: this rank's plan.vocab_rows rows, those past the vocabulary (when tp does not
    divide it) zero, as build_pipeline/shard.py pads them; the final norm."""
    v_l, d = plan.vocab_rows(cfg), cfg.hidden_size
    start, end = plan.vocab_range(cfg, rank)
    real = end - start

    def rows(name: str, std: float) -> torch.Tensor:  # [v_l, d]
        t = draw.normal(name, (v_l, d), std)
        t[real:] = 0
        return t

    out = {"embed": rows("embed", 1.0), "norm": draw.ones(d)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = rows("lm_head", d ** -0.5)
    return out


def layer_tensors(cfg: ModelConfig, plan: ParallelPlan, rank: int, i: int, draw: Draw) -> dict[str, torch.Tensor]:
    """Rank `rank`'s stored tensors of layer i (build_pipeline/shard.py's names, shapes and dtypes)."""
    d, h, tp = cfg.hidden_size, cfg.num_heads, plan.tp
    h_l, p, r, c, u = h // tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    pre, w = f"layers.{i}.", draw.out_scale
    one = draw.ones
    out = {pre + "attn_norm": one(d), pre + "mlp_norm": one(d),
           pre + "attn.kv_a": draw.normal(pre + "attn.kv_a", (c + r, d), d ** -0.5, piece="all"),  # [c+r, d]
           pre + "attn.kv_a_norm": one(c),
           pre + "attn.w_uk": draw.normal(pre + "attn.w_uk", (h_l, p, c), c ** -0.5),  # [h_l, p, c]
           pre + "attn.w_uv": draw.normal(pre + "attn.w_uv", (h_l, u, c), c ** -0.5),  # [h_l, u, c]
           pre + "attn.o": draw.normal(pre + "attn.o", (d, h_l * u), w * (h * u) ** -0.5)}  # [d, h_l*u]
    if cfg.q_lora_rank is None:
        out[pre + "attn.q"] = draw.normal(pre + "attn.q", (h_l * (p + r), d), d ** -0.5)  # [h_l*(p+r), d]
    else:
        q = cfg.q_lora_rank
        out[pre + "attn.q_a"] = draw.normal(pre + "attn.q_a", (q, d), d ** -0.5, piece="all")  # [q, d]
        out[pre + "attn.q_a_norm"] = one(q)
        out[pre + "attn.q_b"] = draw.normal(pre + "attn.q_b", (h_l * (p + r), q), q ** -0.5)  # [h_l*(p+r), q]
    if not cfg.is_moe_layer(i):
        out.update(_mlp(pre + "mlp", d, cfg.intermediate_size, tp, draw))
        return out
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    out[pre + "moe.gate"] = draw.normal(pre + "moe.gate", (e, d), d ** -0.5, piece="all")  # [e, d]
    out[pre + "moe.gate_bias"] = draw.normal(pre + "moe.gate_bias", (e,), 0.01, piece="all", dtype=torch.float32)
    if cfg.n_shared_experts:
        out.update(_mlp(pre + "moe.shared", d, inter * cfg.n_shared_experts, tp, draw))
    out.update(_experts(cfg, pre + "moe", d, inter, tp, draw))
    return out


def _mlp(stem: str, d: int, inter: int, tp: int, draw: Draw) -> dict[str, torch.Tensor]:
    i_l = inter // tp
    return {stem + ".gate_up": draw.normal(stem + ".gate_up", (2 * i_l, d), d ** -0.5),  # [2*i_l, d]
            stem + ".down": draw.normal(stem + ".down", (d, i_l), draw.out_scale * inter ** -0.5)}  # [d, i_l]


def _experts(cfg: ModelConfig, stem: str, d: int, inter: int, tp: int, draw: Draw) -> dict[str, torch.Tensor]:
    """Routed experts, TP-sliced: w13 [e, 2*i_l, d] (gate rows | up rows), w2 [e, d, i_l]; INT4 in the
    moe_w4a16 kernel layout when the config is INT4, else bf16."""
    e, i_l = cfg.n_routed_experts, inter // tp
    shapes = {"w13": ((2 * i_l, d), d, 1.0), "w2": ((d, i_l), inter, draw.out_scale)}  # shape, fan_in, extra
    if cfg.quant is None or cfg.quant.kind != "int4":
        return {f"{stem}.{k}": torch.stack([draw.normal(f"{stem}.{k}", s, extra * fan ** -0.5, piece=(draw.rank, j))
                                            for j in range(e)]) for k, (s, fan, extra) in shapes.items()}
    out = {}
    for k, ((n, kk), fan, extra) in shapes.items():
        base = extra * (fan * _Q_SQ * _U_SQ) ** -0.5
        kp = padded_k(kk)
        dev = draw.device
        # fragment order, as `kdtree build` writes it (plugins/moe_w4a16/fragment_layout.py); padding groups 0
        packed = torch.empty((e, n // 32, kp // GROUP, 32, 4), dtype=torch.int32, device=dev)
        scale = torch.zeros((e, n // 32, kp // GROUP, 8, 4), dtype=torch.bfloat16, device=dev)
        for j in range(e):
            g = draw.gen(f"{stem}.{k}", (draw.rank, j))
            packed[j] = _random_fragment_words(g, n, kk)
            u = 0.5 + torch.rand((kk // GROUP, n), generator=g, device=dev)  # [k/32, n]
            sign = torch.randint(0, 2, (kk // GROUP, n), generator=g, device=dev) * 2 - 1  # cancels q's mean -0.5
            s = (u * sign * base).to(torch.bfloat16)  # [k/32, n]
            # iid draws: any fixed placement of them is as good as the checkpoint's
            scale[j, :, : kk // GROUP] = s.T.reshape(n // 32, 32, kk // GROUP).transpose(1, 2).reshape(
                n // 32, kk // GROUP, 8, 4)
        out[f"{stem}.{k}_packed"], out[f"{stem}.{k}_scale"] = packed, scale
    return out


def _random_fragment_words(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """[n/32, kp/32, 32, 4] int32 words of the fragment order whose values are iid uniform on [-8, 7] (any word
    is valid; the order of iid values does not matter); padding groups (k..kp) are code 8, i.e. q = 0."""
    kp = padded_k(k)
    words = torch.randint(-2**31, 2**31, (n // 32, kp // GROUP, 32, 4), generator=g, dtype=torch.int32,
                          device=g.device)
    words[:, k // GROUP:] = 0x88888888 - 2**32
    return words


def drafter_config(preset: str, target_layers: int) -> DrafterConfig:
    """The preset's drafter for a target of `target_layers` layers: tapped layer ids beyond a reduced-depth
    target are clamped to its last layer (the feature width, hence fc, stays the preset's)."""
    raw = copy.deepcopy(DRAFTERS[preset])
    ids = raw["dflash_config"]["target_layer_ids"]
    raw["dflash_config"]["target_layer_ids"] = [min(i, target_layers - 1) for i in ids]
    return parse_drafter_config(raw, source=f"--synthetic {preset} drafter")


def drafter_tensors(dcfg: DrafterConfig, target_hidden: int, seed: int, device: str | torch.device
                    ) -> dict[str, torch.Tensor]:
    """A DFlash drafter's whole tensors {core/weight_map.drafter_specs key: tensor} with random weights,
    replicated (the same on every rank; runtime/load/drafter.py cuts a sharded one): N(0, 1/fan_in),
    the residual writers (o, down) further / sqrt(2 * layers), norms 1."""
    draw = Draw(seed, rank=0, out_scale=(2 * dcfg.num_layers) ** -0.5, device=device)
    d, e, i = dcfg.hidden_size, dcfg.head_dim, dcfg.intermediate_size
    h, g, f = dcfg.num_heads * e, dcfg.num_kv_heads * e, len(dcfg.target_layer_ids) * target_hidden
    w = draw.out_scale

    def n(name, shape, std):
        return draw.normal("drafter." + name, shape, std, piece="all")

    out = {"fc": n("fc", (d, f), f ** -0.5), "hidden_norm": draw.ones(d), "norm": draw.ones(d)}  # fc [d, F]
    for li in range(dcfg.num_layers):
        p = f"layers.{li}."
        out.update({p + "attn_norm": draw.ones(d), p + "mlp_norm": draw.ones(d), p + "q_norm": draw.ones(e),
                    p + "k_norm": draw.ones(e), p + "q": n(p + "q", (h, d), d ** -0.5),  # [h*e, d]
                    p + "k": n(p + "k", (g, d), d ** -0.5), p + "v": n(p + "v", (g, d), d ** -0.5),  # [g*e, d]
                    p + "o": n(p + "o", (d, h), w * h ** -0.5),  # [d, h*e]
                    p + "gate": n(p + "gate", (i, d), d ** -0.5), p + "up": n(p + "up", (i, d), d ** -0.5),
                    p + "down": n(p + "down", (d, i), w * i ** -0.5)})  # [d, i]
    return out
