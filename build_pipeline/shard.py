"""Per-rank weights: the checkpoint streamed once, cut by the ParallelPlan, repacked for the kernels.

Letters: h heads (h_l per rank), p qk_nope dims, r rope dims, c latent, u v_head_dim, q q_lora_rank,
d hidden, i intermediate (i_l per rank), e experts (e_l per rank), v vocab (v_l per rank), g INT4 group.

Files per rank (rank{r}/, safetensors, our names):
  globals.safetensors        embed [v_l, d], norm [d], lm_head [v_l, d] (absent when tied)
  layer.{i:03d}.safetensors  layers.{i}.attn_norm [d], .mlp_norm [d],
                             .attn.q_a [q, d], .attn.q_a_norm [q],
                             .attn.q_b [h_l*(p+r), q]  (or .attn.q [h_l*(p+r), d]),
                             .attn.kv_a [c+r, d], .attn.kv_a_norm [c],
                             .attn.w_uk [h_l, p, c], .attn.w_uv [h_l, u, c]   (kv_b split for the absorbed form),
                             .attn.o [d, h_l*u],
                             dense: .mlp.gate_up [2*i_l, d] (gate rows | up rows), .mlp.down [d, i_l];
                             MoE:   .moe.gate [e, d], .moe.gate_bias [e], .moe.shared.gate_up, .moe.shared.down,
                                    INT4 experts kept packed, in the moe_w4a16 v3 kernel layout (fragment order,
                                    plugins/moe_w4a16/fragment_layout.py; k padded to kp = ceil(k/256)*256):
                                    .moe.w13_packed [e_l, 2*i_l/32, dp/32, 32, 4] int32,
                                    .moe.w13_scale [e_l, 2*i_l/32, dp/32, 8, 4],
                                    .moe.w2_packed [e_l, d/32, i_lp/32, 32, 4] int32,
                                    .moe.w2_scale [e_l, d/32, i_lp/32, 8, 4]
                                    (artifacts built before hold the planar layout, layout.py, also read);
                                    or dense experts .moe.w13 [e_l, 2*i_l, d], .moe.w2 [e_l, d, i_l].
Float tensors are stored bf16 when that is exact, else fp32 (lossless either way).  The input is read
one layer at a time, so peak memory is one layer of the checkpoint plus its tp slices.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.config import ModelConfig
from core.errors import CheckpointError
from core.loader import WeightLoader
from core.plan import ParallelPlan
from core.progress import Progress
from core.weight_map import TensorSpec, target_specs
from plugins.moe_w4a16 import pack_int4_experts

GLOBALS_FILE = "globals.safetensors"
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a checkpoint tensor of decoder layer N


def layer_file(layer: int) -> str:
    return f"layer.{layer:03d}.safetensors"


@dataclass
class Int4:
    """An unpacked INT4 weight: q int8 [out, in] in [-8, 7], scale fp32 [out, in/g]."""

    q: torch.Tensor
    scale: torch.Tensor


def write_rank_shards(model_dir: str | Path, cfg: ModelConfig, plan: ParallelPlan, out: Path,
                      progress: bool = True) -> dict[int, list[str]]:
    """Write rank{r}/*.safetensors under `out` for every rank; returns {rank: [relative file paths]}."""
    plan.validate(cfg)
    loader = WeightLoader(model_dir, cfg.tensor_prefix, cfg.quant)
    specs = target_specs(cfg)
    loader.check(specs)
    _check_no_extra_layers(loader, cfg)
    groups: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        groups.setdefault(_group_of(spec.key), []).append(spec)
    files: dict[int, list[str]] = {r: [] for r in range(plan.tp)}
    for r in files:
        (out / f"rank{r}").mkdir(parents=True, exist_ok=True)
    bar = Progress(len(groups), "sharding weights", enabled=progress)
    for group, group_specs in groups.items():
        flat = {s.key: _read(loader, s) for s in group_specs}
        for r in range(plan.tp):
            tensors = shard_group(cfg, plan, flat, r)
            name = GLOBALS_FILE if group == "globals" else layer_file(int(group))
            save_rank_file({k: _lossless(k, t) for k, t in tensors.items()}, out / f"rank{r}" / name, r, plan.tp)
            files[r].append(f"rank{r}/{name}")
        bar.advance()
    bar.close()
    return files


def _check_no_extra_layers(loader: WeightLoader, cfg: ModelConfig) -> None:
    """Layers past num_hidden_layers (+ the MTP layers, present and never run) mean config.json and the
    checkpoint disagree: refuse rather than silently drop their tensors."""
    known = cfg.num_layers + cfg.num_mtp_layers
    extra = sorted(i for i in (int(m.group(1)) for m in map(_LAYER_NAME.search, loader.ckpt.names()) if m)
                   if i >= known)
    if extra:
        raise CheckpointError(f"{loader.where}: {len(extra)} tensors of layers {extra[0]}..{extra[-1]} lie past "
                              f"num_hidden_layers {cfg.num_layers} (+ {cfg.num_mtp_layers} MTP) of config.json; "
                              f"the config and the checkpoint disagree")


def save_rank_file(tensors: dict[str, torch.Tensor], path: Path, rank: int, tp: int) -> None:
    """One rank file, its bytes a function of the tensors alone: safetensors writes `__metadata__` from a
    hash map (a different order each run), so the header is rewritten in place with it sorted; the
    header keeps its length (the same compact JSON, keys reordered), so the data does not move."""
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "kdtree-rank", "rank": str(rank),
                                                                    "tp": str(tp)})
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        canon = json.dumps(header, separators=(",", ":")).encode()
        if len(canon) <= n:  # always, for the compact JSON safetensors writes
            f.seek(8)
            f.write(canon + b" " * (n - len(canon)))


def shard_group(cfg: ModelConfig, plan: ParallelPlan, flat: dict[str, torch.Tensor | Int4],
                rank: int) -> dict[str, torch.Tensor]:
    """One rank's stored tensors for one group of weight_map keys (a layer, or the globals)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor | Int4]]] = {}
    mlps: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        if ".moe.experts." in key:
            pre, rest = key.split(".moe.experts.")
            j, proj = rest.split(".")
            if plan.holds(cfg, key, rank):
                experts.setdefault(pre, {}).setdefault(int(j), {})[proj] = _cut(plan, key, t, rank)
        elif key.endswith((".mlp.gate", ".mlp.up", ".mlp.down", ".shared.gate", ".shared.up", ".shared.down")):
            stem, proj = key.rsplit(".", 1)
            mlps.setdefault(stem, {})[proj] = plan.shard(key, t, rank)
        elif key.endswith(".attn.kv_b"):
            h_l, p, u = plan.local_heads(cfg), cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = plan.shard(key, t, rank).view(h_l, p + u, cfg.kv_lora_rank)  # [h_l, p+u, c]
            stem = key[: -len(".kv_b")]
            out[stem + ".w_uk"] = kv_b[:, :p].contiguous()  # [h_l, p, c]
            out[stem + ".w_uv"] = kv_b[:, p:].contiguous()  # [h_l, u, c]
        else:
            out[key] = plan.shard(key, t, rank).contiguous()
    for stem, m in mlps.items():
        out[stem + ".gate_up"] = torch.cat([m["gate"], m["up"]], dim=0)  # [2*i_l, d]
        out[stem + ".down"] = m["down"].contiguous()  # [d, i_l]
    for pre, by_expert in experts.items():
        out.update(_stack_experts(pre + ".moe", [by_expert[j] for j in sorted(by_expert)]))
    return out


def _stack_experts(stem: str, experts: list[dict[str, torch.Tensor | Int4]]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down (this rank's cut) -> stacked w13 / w2, INT4 kept packed."""
    first = experts[0]["gate"]
    if isinstance(first, Int4):
        w13_q = torch.stack([torch.cat([x["gate"].q, x["up"].q]) for x in experts])  # [e_l, 2*i_l, d]
        w13_s = torch.stack([torch.cat([x["gate"].scale, x["up"].scale]) for x in experts])  # [e_l, 2*i_l, d/g]
        w2_q = torch.stack([x["down"].q for x in experts])  # [e_l, d, i_l]
        w2_s = torch.stack([x["down"].scale for x in experts])  # [e_l, d, i_l/g]
        w13_p, w13_s, w2_p, w2_s = pack_int4_experts(w13_q, w13_s, w2_q, w2_s)  # fragment order
        return {stem + ".w13_packed": w13_p, stem + ".w13_scale": w13_s,
                stem + ".w2_packed": w2_p, stem + ".w2_scale": w2_s}
    return {stem + ".w13": torch.stack([torch.cat([x["gate"], x["up"]]) for x in experts]),  # [e_l, 2*i_l, d]
            stem + ".w2": torch.stack([x["down"] for x in experts])}  # [e_l, d, i_l]


def _cut(plan: ParallelPlan, key: str, t: torch.Tensor | Int4, rank: int) -> torch.Tensor | Int4:
    """plan.shard for one expert's weight; INT4 cuts values and scales consistently (whole groups)."""
    if not isinstance(t, Int4):
        return plan.shard(key, t, rank)
    # rows (gate/up) cut plainly; the in-dim of down cuts q columns in/tp and scale columns in/(g*tp):
    # plan.validate checked (in/tp) % g == 0, so every rank holds whole scale groups
    return Int4(plan.shard(key, t.q, rank), plan.shard(key, t.scale, rank))


def _read(loader: WeightLoader, spec: TensorSpec) -> torch.Tensor | Int4:
    """INT4-packed experts stay quantised (values + scales); everything else is read as fp32."""
    if loader.storage(spec) == "int4":
        q, scale = loader.load_int4(spec)
        _check_finite(loader, spec, scale)
        return Int4(q, scale)
    return _check_finite(loader, spec, loader.load(spec, torch.float32))


def _check_finite(loader: WeightLoader, spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """One reduction per tensor as it streams by: a NaN or Inf weight turns every output into garbage
    without any other error, so the build refuses it, naming the tensor."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{loader.where}: weight {spec.ckpt!r} ({spec.key}) holds {bad} non-finite value(s) "
                              f"(NaN or Inf); refusing to build")
    return t


def _lossless(key: str, t: torch.Tensor) -> torch.Tensor:
    """bf16 when every value survives the round trip, else fp32; integer tensors as they are."""
    if not t.is_floating_point():
        return t.contiguous()
    t = t.float()
    b = t.to(torch.bfloat16)
    return b.contiguous() if torch.equal(b.float(), t) else t.contiguous()


def _group_of(key: str) -> str:
    """'globals' or the layer index as text."""
    if key.startswith("layers."):
        return key.split(".")[1]
    return "globals"
