"""Loading a `kdtree build` artifact: each rank reads only its own shard files.

An artifact folder holds manifest.json (format, model config, plan, per-rank files with sha256,
kernels, graphs, toolchain, options), rank{r}/*.safetensors (build_pipeline/shard.py lists the
tensors), kernels/, graphs/, tokenizer/ and, when built with --drafter, drafter/ (copied as is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline.config import ModelConfig
from build_pipeline.errors import CheckpointError
from build_pipeline.moe_layout import dequantize_kernel_layout
from build_pipeline.plan import ParallelPlan
from build_pipeline.safetensors_file import SafetensorsFile
from runtime.weights import AttentionWeights, Int4Experts, LayerWeights, MLPWeights, MoEWeights, TargetWeights

MANIFEST = "manifest.json"
FORMAT = "kdtree-artifact"


@dataclass
class RankBundle:
    cfg: ModelConfig
    plan: ParallelPlan
    rank: int
    weights: TargetWeights  # this rank's slice; INT4 experts both packed (MoEWeights.int4) and dequantised
    drafter_dir: Path | None  # replicated drafter, copied into the artifact at build time
    manifest: dict
    art_dir: Path | None = None

    @property
    def tokenizer_dir(self) -> Path:
        """Tokenizer files copied from the model dir (Tokenizer.load reads this folder)."""
        return Path(self.art_dir) / "tokenizer"


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


def load_rank(art_dir: str | Path, rank: int, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> RankBundle:
    """Read rank `rank`'s files of an artifact into TargetWeights on `device`.

    dtype: float weights' dtype (default fp32 on CPU, bf16 on CUDA); the router stays >= fp32, as in
    runtime.weights.load_target_weights.  Only rank{rank}/ files are opened.
    """
    manifest = read_manifest(art_dir)
    cfg = ModelConfig.from_dict(manifest["model"])
    plan = ParallelPlan.from_dict(manifest["plan"])
    if not 0 <= rank < plan.tp:
        raise ValueError(f"rank {rank} outside [0, {plan.tp}) for this artifact (built with --tp {plan.tp})")
    dtype = dtype or (torch.float32 if str(device) == "cpu" else torch.bfloat16)
    flat: dict[str, torch.Tensor] = {}
    for entry in manifest["ranks"][str(rank)]["files"]:
        shard = SafetensorsFile(Path(art_dir) / entry["path"])
        for name in shard.keys():
            flat[name] = shard.tensor(name)
        shard.close()
    weights = _assemble(cfg, flat, dtype, device)
    drafter = Path(art_dir) / "drafter"
    return RankBundle(cfg, plan, rank, weights, drafter if drafter.is_dir() else None, manifest, Path(art_dir))


def _assemble(cfg: ModelConfig, flat: dict[str, torch.Tensor], dtype: torch.dtype, device) -> TargetWeights:
    def get(key: str, keep: torch.dtype = dtype) -> torch.Tensor:
        if key not in flat:
            raise CheckpointError(f"artifact: tensor {key!r} missing from this rank's files")
        return flat.pop(key).to(device=device, dtype=keep)

    router = dtype if dtype == torch.float64 else torch.float32
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
            int4 = None
            if p + "moe.w13_packed" in flat:  # stored in the kernel layout (build_pipeline/moe_layout.py)
                int4 = Int4Experts(w13=flat.pop(p + "moe.w13_packed"), w13_scale=flat.pop(p + "moe.w13_scale"),
                                   w2=flat.pop(p + "moe.w2_packed"), w2_scale=flat.pop(p + "moe.w2_scale"))
                w13 = dequantize_kernel_layout(int4.w13, int4.w13_scale, cfg.hidden_size)  # [e_l, 2*i_l, d]
                w2 = dequantize_kernel_layout(int4.w2, int4.w2_scale, int4.w13.shape[-2] // 2)  # [e_l, d, i_l]
                int4 = Int4Experts(*(t.to(device) for t in (int4.w13, int4.w13_scale, int4.w2, int4.w2_scale)))
            else:
                w13, w2 = flat.pop(p + "moe.w13"), flat.pop(p + "moe.w2")
            shared = (MLPWeights(get(p + "moe.shared.gate_up"), get(p + "moe.shared.down"))
                      if cfg.n_shared_experts else None)
            mlp: MLPWeights | MoEWeights = MoEWeights(
                gate=get(p + "moe.gate", router), gate_bias=get(p + "moe.gate_bias", router),
                w13=w13.to(device=device, dtype=dtype), w2=w2.to(device=device, dtype=dtype), shared=shared,
                int4=int4)
        else:
            mlp = MLPWeights(get(p + "mlp.gate_up"), get(p + "mlp.down"))
        layers.append(LayerWeights(get(p + "attn_norm"), attn, get(p + "mlp_norm"), mlp))
    embed = get("embed")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head")
    return TargetWeights(embed=embed, layers=layers, norm=get("norm"), lm_head=lm_head)
