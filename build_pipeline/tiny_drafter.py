"""`kdtree make-tiny --drafter-for TARGET OUT`: a small random DFlash drafter in z-lab's format
(Qwen3 config + `dflash_config`, tensors without `model.` prefix, no embeddings or lm_head)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from core.config import load_config
from core.staging import staged_dir


def default_target_layer_ids(num_target_layers: int, taps: int) -> list[int]:
    """Evenly spaced taps over layers 1 .. n-2 (z-lab's rule gives [1, 12, 24, 35, 47, 58] for 61/6)."""
    if num_target_layers < 3:
        return list(range(num_target_layers))[:taps]
    lo, hi = 1, num_target_layers - 3 if num_target_layers > 4 else num_target_layers - 2
    if taps == 1:
        return [num_target_layers // 2]
    return sorted({round(lo + i * (hi - lo) / (taps - 1)) for i in range(taps)})


def target_fingerprint(target_dir: str | Path) -> str:
    """core/fingerprint.py's fingerprint of the checkpoint's embedding, read through the real loader."""
    from core.fingerprint import embedding_fingerprint
    from core.loader import WeightLoader
    from core.weight_map import target_specs

    cfg = load_config(target_dir)
    spec = next(s for s in target_specs(cfg) if s.key == "embed")
    for _, embed in WeightLoader(target_dir, cfg.tensor_prefix, cfg.quant).stream([spec], torch.float32):
        return embedding_fingerprint(embed)
    raise ValueError(f"{target_dir}: no embedding tensor")


def make_tiny_drafter(target_dir: str | Path, out: str | Path, layers: int = 2, block_size: int = 8, taps: int = 2,
                      seed: int = 0, force: bool = False) -> Path:
    from safetensors.torch import save_file

    from core.drafter_config import parse_drafter_config
    from core.weight_map import drafter_specs

    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():  # --force replaces a drafter folder, never a file
        raise FileExistsError(f"{out}: exists and is not a directory (--force replaces only a folder)")
    t = load_config(target_dir)
    heads, kv_heads, head_dim = 4, 2, 32
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 2 * t.hidden_size,
        "num_hidden_layers": layers,
        "num_target_layers": t.num_layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": 50000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": t.vocab_size - 2,
                          "target_layer_ids": default_target_layer_ids(t.num_layers, taps),
                          "target_fingerprint": target_fingerprint(target_dir)},
        "torch_dtype": "bfloat16",
    }
    dcfg = parse_drafter_config(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in drafter_specs(dcfg, t.hidden_size):
        if len(spec.shape) == 1:
            w = 1.0 + 0.1 * torch.randn(spec.shape, generator=g)
        else:
            w = torch.randn(spec.shape, generator=g) / math.sqrt(spec.shape[1])
        tensors[spec.ckpt] = w.to(torch.bfloat16)
    with staged_dir(out) as stage:
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
