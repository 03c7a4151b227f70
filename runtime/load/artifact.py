"""Reading a `kdtree build` artifact: each rank reads only its own shard files.

An artifact folder holds manifest.json (format, model config, plan, per-rank files with sha256,
kernels, graphs, toolchain, options), rank{r}/*.safetensors (build_pipeline/shard.py lists the
tensors and is the only code that cuts weights), kernels/, graphs/, tokenizer/ and, when built with
--drafter, drafter/ (copied as is).  The tensors are grouped into runtime/model/weights.py's
classes as stored: routed experts stay in the one form the build wrote (INT4 kernel layout or
dense), nothing is dequantised or cut here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline.artifact_cache import FORMAT, MANIFEST
from core.config import ModelConfig
from core.errors import CheckpointError
from core.plan import ParallelPlan
from core.safetensors_file import SafetensorsFile
from runtime.model.weights import (
    AttentionWeights,
    Experts,
    LayerWeights,
    MLPWeights,
    MoEWeights,
    TargetWeights,
)


@dataclass
class RankBundle:
    cfg: ModelConfig
    plan: ParallelPlan
    rank: int
    weights: TargetWeights  # this rank's slice; routed experts in one form (INT4 packed, or dense)
    drafter_dir: Path | None  # replicated drafter, copied into the artifact at build time
    manifest: dict


def is_artifact(path: str | Path) -> bool:
    """True when `path` is a built artifact folder (has a kdtree manifest)."""
    m = Path(path) / MANIFEST
    if not m.is_file():
        return False
    try:
        return json.loads(m.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def read_manifest(art_dir: str | Path) -> dict:
    path = Path(art_dir) / MANIFEST
    if not is_artifact(art_dir):
        raise CheckpointError(f"{art_dir}: not a kdtree artifact (no valid {MANIFEST}; run `kdtree build`)")
    return json.loads(path.read_text())


def read_rank(art_dir: str | Path, rank: int, device: str | torch.device, dtype: torch.dtype) -> RankBundle:
    """Read rank `rank`'s files of an artifact into TargetWeights on `device`.

    dtype: the float weights' dtype; the router stays >= fp32, INT4 experts stay int32 with their
    stored scales.  Only rank{rank}/ files are opened; each tensor goes to `device` as it is read, so
    host memory holds one tensor at a time beyond the page cache.
    """
    manifest = read_manifest(art_dir)
    cfg = ModelConfig.from_dict(manifest["model"])
    plan = ParallelPlan.from_dict(manifest["plan"])
    if not 0 <= rank < plan.tp:
        raise ValueError(f"rank {rank} outside [0, {plan.tp}) for this artifact (built with --tp {plan.tp})")
    router = dtype if dtype == torch.float64 else torch.float32  # the router in at least fp32
    flat: dict[str, torch.Tensor] = {}
    if str(rank) not in manifest["ranks"]:  # a synthetic artifact holds one rank of its plan
        raise CheckpointError(f"{art_dir}: rank {rank} is not in this artifact (it holds ranks "
                              f"{sorted(manifest['ranks'], key=int)})")
    for entry in manifest["ranks"][str(rank)]["files"]:
        shard = SafetensorsFile(Path(art_dir) / entry["path"])
        for name in shard.keys():
            t = shard.tensor(name)
            if name.endswith(("moe.gate", "moe.gate_bias")):
                t = t.to(device=device, dtype=router)
            elif t.is_floating_point() and not name.endswith("_scale"):  # INT4 scales: as the kernel reads them
                t = t.to(device=device, dtype=dtype)
            flat[name] = t.to(device=device)
        shard.close()
    weights = _assemble(cfg, flat)
    drafter = Path(art_dir) / "drafter"
    return RankBundle(cfg, plan, rank, weights, drafter if drafter.is_dir() else None, manifest)


def _assemble(cfg: ModelConfig, flat: dict[str, torch.Tensor]) -> TargetWeights:
    """Group a rank's {stored name: tensor} (build_pipeline/shard.py's names) into TargetWeights."""
    def get(key: str) -> torch.Tensor:
        if key not in flat:
            raise CheckpointError(f"artifact: tensor {key!r} missing from this rank's files")
        return flat.pop(key)

    layers = []
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        q_lora = cfg.q_lora_rank is not None
        attn = AttentionWeights(
            q_a=get(p + "attn.q_a") if q_lora else None,
            q_a_norm=get(p + "attn.q_a_norm") if q_lora else None,
            q_b=get(p + ("attn.q_b" if q_lora else "attn.q")),
            kv_a=get(p + "attn.kv_a"), kv_a_norm=get(p + "attn.kv_a_norm"),
            w_uk=get(p + "attn.w_uk"), w_uv=get(p + "attn.w_uv"), o=get(p + "attn.o"))
        if cfg.is_moe_layer(li):
            if p + "moe.w13_packed" in flat:  # INT4, in plugins/moe_w4a16/layout.py's kernel layout
                experts = Experts(get(p + "moe.w13_packed"), get(p + "moe.w13_scale"), get(p + "moe.w2_packed"),
                                  get(p + "moe.w2_scale"))
            else:
                experts = Experts(get(p + "moe.w13"), None, get(p + "moe.w2"), None)
            shared = (MLPWeights(get(p + "moe.shared.gate_up"), get(p + "moe.shared.down"))
                      if cfg.n_shared_experts else None)
            mlp: MLPWeights | MoEWeights = MoEWeights(gate=get(p + "moe.gate"), gate_bias=get(p + "moe.gate_bias"),
                                                      experts=experts, shared=shared)
        else:
            mlp = MLPWeights(get(p + "mlp.gate_up"), get(p + "mlp.down"))
        layers.append(LayerWeights(get(p + "attn_norm"), attn, get(p + "mlp_norm"), mlp))
    embed = get("embed")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head")
    return TargetWeights(embed=embed, layers=layers, norm=get("norm"), lm_head=lm_head)
