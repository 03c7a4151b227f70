"""Reading a `kdtree build` artifact: each rank reads only its own shard files.

An artifact folder holds manifest.json (format, model config, plan, per-rank files with sha256,
kernels, graphs, toolchain, options), rank{r}/*.safetensors (build_pipeline/shard.py lists the
tensors and is the only code that cuts weights), kernels/, graphs/, tokenizer/ and, when built with
--drafter, drafter/ (copied as is).  The tensors are grouped into runtime/model/weights.py's
classes as stored: routed experts stay in the one form the build wrote (INT4 kernel layout or
dense), nothing is dequantised or cut here.  Every file a rank reads (its rank files, tokenizer/,
drafter/) is checked against the manifest's sha256 while it is read (build_pipeline/integrity.py).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline.artifact_cache import FORMAT, MANIFEST
from build_pipeline.integrity import FileCheck
from core.config import ModelConfig
from core.errors import CheckpointError
from core.plan import ParallelPlan
from core.safetensors_file import SafetensorsFile
from plugins.moe_w4a16 import planar_copy, v3_multiplies
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
    """The artifact's manifest; CheckpointError naming the manifest when it is missing, unreadable or
    not a kdtree manifest."""
    path = Path(art_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{art_dir}: not a kdtree artifact (no {MANIFEST}; run `kdtree build`)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.__class__.__name__}: the manifest is truncated or "
                              f"corrupted; rebuild with `kdtree build --force`)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a kdtree artifact manifest (no \"format\": \"{FORMAT}\")")
    return manifest


def read_rank(art_dir: str | Path, rank: int, device: str | torch.device, dtype: torch.dtype,
              manifest: dict | None = None) -> RankBundle:
    """Read rank `rank`'s files of an artifact into TargetWeights on `device`.

    dtype: the float weights' dtype; the router stays >= fp32, INT4 experts stay int32 with their
    stored scales.  Only rank{rank}/ files are opened; each tensor goes to `device` as it is read, so
    host memory holds one tensor at a time beyond the page cache.  manifest: read_manifest(art_dir), when
    the caller has it already.
    """
    manifest = manifest if manifest is not None else read_manifest(art_dir)
    cfg = ModelConfig.from_dict(manifest["model"])
    plan = ParallelPlan.from_dict(manifest["plan"])
    if not 0 <= rank < plan.tp:
        raise ValueError(f"rank {rank} outside [0, {plan.tp}) for this artifact (built with --tp {plan.tp})")
    flat: dict[str, torch.Tensor] = {}
    if str(rank) not in manifest["ranks"]:  # a synthetic artifact holds one rank of its plan
        raise CheckpointError(f"{art_dir}: rank {rank} is not in this artifact (it holds ranks "
                              f"{sorted(manifest['ranks'], key=int)})")
    # every file this rank reads is checked against the manifest while it is read (integrity.py)
    check = FileCheck(art_dir, workers=max(1, (os.cpu_count() or 1) // plan.tp))
    try:
        for rel, info in manifest.get("files", {}).items():
            if rel.startswith(("drafter/", "tokenizer/")):
                check.submit(rel, info)
        for entry in manifest["ranks"][str(rank)]["files"]:
            shard = SafetensorsFile(check.submit(entry["path"], entry))
            for name in shard.keys():
                flat[name] = place(name, shard.tensor(name), device, dtype)
            shard.close()
    except BaseException:
        check.close()
        raise
    check.wait()
    weights = assemble_weights(cfg, flat)
    drafter = Path(art_dir) / "drafter"
    return RankBundle(cfg, plan, rank, weights, drafter if drafter.is_dir() else None, manifest)


def place(name: str, t: torch.Tensor, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stored tensor as the runtime holds it: on `device`, float weights in `dtype`, the router's bias in
    at least fp32 and its gate as stored when that is `dtype` (else at least fp32), INT4 words and scales
    as the kernel reads them."""
    router = dtype if dtype == torch.float64 else torch.float32
    if name.endswith("moe.gate"):  # a gate stored in the model dtype stays so (exact; runtime/model/moe.router_logits)
        return t.to(device=device, dtype=t.dtype if t.dtype == dtype else router)
    if name.endswith("moe.gate_bias"):
        return t.to(device=device, dtype=router)
    if t.is_floating_point() and not name.endswith("_scale"):
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


class MoEKernelWarning(UserWarning):
    """The INT4 experts run the Triton v2c kernels on a planar copy instead of v3 (which could not load)."""


def kernel_form(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                dtype: torch.dtype, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4 experts in the layout the op's path for this run reads: as stored, except fragment order on CUDA
    where v3 does not serve (v3_problem), which becomes the planar layout of the Triton path, once, here.  The
    CPU reference reads either layout.  (launch_v3.unavailable remembers its verdict per device: the check,
    which may try to compile, runs once per process, not per layer.)"""
    if w13.dim() != 5 or not w13.is_cuda:
        return w13, w13_scale, w2, w2_scale
    return serving_form(w13, w13_scale, w2, w2_scale, d, v3_problem(w13.device, dtype, w13_scale.dtype))


def v3_problem(device: torch.device, dtype: torch.dtype, scale_dtype: torch.dtype) -> str | None:
    """None when moe_w4a16 v3 serves fragment-order experts on CUDA `device` in `dtype`, else why not: tokens or
    scales other than bf16 (v3 multiplies bf16: expected, no warning), or no v3 kernels for this GPU (no cubin
    for its arch and neither NVRTC nor nvcc, no cuda-python: "unavailable: ...")."""
    if not v3_multiplies(dtype, scale_dtype):
        return f"{dtype} tokens with {scale_dtype} scales"
    from plugins.moe_w4a16.launch_v3 import unavailable
    why = unavailable(device)
    return None if why is None else f"unavailable: {why}"


def serving_form(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, d: int,
                 problem: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fragment-order experts as they are (problem None), else their planar copy (plugins/moe_w4a16.planar_copy,
    exact) for the Triton v2c path, with one MoEKernelWarning when v3 was expected but is unavailable."""
    if problem is None:
        return w13, w13_scale, w2, w2_scale
    if problem.startswith("unavailable"):
        warnings.warn(MoEKernelWarning(f"moe_w4a16 v3 {problem}; the experts run the Triton v2c kernels on a "
                                       f"planar copy"), stacklevel=3)
    return planar_copy(w13, w13_scale, w2, w2_scale, d)


def stack_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [m, d], b [k, d] -> the same values as row views of one [m + k, d] tensor (copied once, the originals
    freed with their last reference), so the forward multiplies both in one GEMM (AttentionWeights.latent_inputs,
    MoEWeights.router_inputs)."""
    both = torch.cat([a, b])  # [m + k, d]
    return both[:a.shape[0]], both[a.shape[0]:]


def assemble_weights(cfg: ModelConfig, flat: dict[str, torch.Tensor]) -> TargetWeights:
    """Group a rank's {stored name: tensor} (build_pipeline/shard.py's names) into TargetWeights."""
    def get(key: str) -> torch.Tensor:
        if key not in flat:
            raise CheckpointError(f"artifact: tensor {key!r} missing from this rank's files")
        return flat.pop(key)

    layers = []
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        q_lora = cfg.q_lora_rank is not None
        q_a, kv_a = stack_rows(get(p + "attn.q_a"), get(p + "attn.kv_a")) if q_lora else (None, get(p + "attn.kv_a"))
        attn = AttentionWeights(
            q_a=q_a, q_a_norm=get(p + "attn.q_a_norm") if q_lora else None,
            q_b=get(p + ("attn.q_b" if q_lora else "attn.q")),
            kv_a=kv_a, kv_a_norm=get(p + "attn.kv_a_norm"),
            w_uk=get(p + "attn.w_uk"), w_uv=get(p + "attn.w_uv"), o=get(p + "attn.o"))
        if cfg.is_moe_layer(li):
            if p + "moe.w13_packed" in flat:  # INT4, in a moe_w4a16 kernel layout (fragment order or planar)
                experts = Experts(*kernel_form(get(p + "moe.w13_packed"), get(p + "moe.w13_scale"),
                                               get(p + "moe.w2_packed"), get(p + "moe.w2_scale"),
                                               flat[p + "attn_norm"].dtype, cfg.hidden_size))
            else:
                experts = Experts(get(p + "moe.w13"), None, get(p + "moe.w2"), None)
            gate = get(p + "moe.gate")
            shared = None
            if cfg.n_shared_experts:
                gate_up = get(p + "moe.shared.gate_up")
                if gate.dtype == gate_up.dtype and gate.shape[1] == gate_up.shape[1]:  # one GEMM for both
                    gate, gate_up = stack_rows(gate, gate_up)
                shared = MLPWeights(gate_up, get(p + "moe.shared.down"))
            mlp: MLPWeights | MoEWeights = MoEWeights(gate=gate, gate_bias=get(p + "moe.gate_bias"),
                                                      experts=experts, shared=shared)
        else:
            mlp = MLPWeights(get(p + "mlp.gate_up"), get(p + "mlp.down"))
        layers.append(LayerWeights(get(p + "attn_norm"), attn, get(p + "mlp_norm"), mlp))
    embed = get("embed")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head")
    return TargetWeights(embed=embed, layers=layers, norm=get("norm"), lm_head=lm_head)
