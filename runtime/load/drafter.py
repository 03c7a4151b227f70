"""Load a DFlash drafter (z-lab's format) for a loaded target: config check, weights streamed to the
target's device and dtype.  The drafter is replicated on every rank; it shares the target's
embedding and lm_head (vocab-parallel under TP)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.drafter_config import load_drafter_config
from core.loader import WeightLoader
from core.progress import Progress
from core.weight_map import drafter_specs
from runtime.model.drafter import DFlashDrafter, DrafterLayerWeights, DrafterWeights
from runtime.model.target import TargetModel


def load_drafter(drafter_dir: str | Path, target: TargetModel, progress: bool = True) -> DFlashDrafter:
    """The drafter of `drafter_dir` for `target` (which must return the drafter's target_layer_ids features)."""
    cfg = load_drafter_config(drafter_dir)
    cfg.check_target(target.cfg)
    if tuple(target.feature_layers) != cfg.target_layer_ids:
        raise ValueError(f"target returns features of layers {target.feature_layers}, drafter needs "
                         f"{cfg.target_layer_ids}")
    loader = WeightLoader(drafter_dir)
    specs = drafter_specs(cfg, target.cfg.hidden_size)
    flat = {}
    bar = Progress(len(specs), "loading drafter", enabled=progress)
    for spec, t in loader.stream(specs, torch.float32):
        flat[spec.key] = t.to(device=target.device, dtype=target.dtype)
        bar.advance()
    bar.close()
    layers = []
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        layers.append(DrafterLayerWeights(
            attn_norm=flat[p + "attn_norm"], q=flat[p + "q"], kv=torch.cat([flat[p + "k"], flat[p + "v"]]),
            o=flat[p + "o"], q_norm=flat[p + "q_norm"], k_norm=flat[p + "k_norm"], mlp_norm=flat[p + "mlp_norm"],
            gate_up=torch.cat([flat[p + "gate"], flat[p + "up"]]), down=flat[p + "down"]))
    weights = DrafterWeights(fc=flat["fc"], hidden_norm=flat["hidden_norm"], layers=layers, norm=flat["norm"])
    return DFlashDrafter(cfg, weights, target)
