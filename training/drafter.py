"""A trainable DFlash drafter with exactly the semantics of runtime/model/drafter.py, its training
objective, and the export in z-lab's format (Qwen3 config + `dflash_config`, no embeddings or head).

Letters: b sequences, l tokens each, k anchor blocks per sequence, s block slots (block_size),
D = s - 1 draft depths, H hidden, F = len(target_layer_ids) * target hidden, v vocabulary.

Objective (DFlash): pick k random anchors p per sequence (1 <= p <= l - s, distinct).  Anchor p sees
the target's features of positions [0, p) as context (fc + hidden_norm, K/V of every layer) and the
block [x_p, mask x D] at positions p .. p + D; attention is non-causal over context + its own block,
blocks never see each other.  Slot t predicts x_{p+t} through the target's (frozen) lm_head; its
cross-entropy is weighted by exp(-(t-1)/gamma) (Recipe.pos_weights).  All k blocks of a sequence run
in one pass over one shared context (a block-sparse mask), as the DFlash training code does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from build_pipeline.tiny_drafter import default_target_layer_ids
from core.drafter_config import DrafterConfig, parse_drafter_config
from core.staging import staged_dir
from core.weight_map import drafter_specs
from plugins.layer_fusion.reference import rms_norm_reference as rms_norm  # autograd: the torch form
from runtime.model.rope import Rope
from training.recipe import Recipe


def drafter_config(r: Recipe, target_cfg: dict, mask_token_id: int) -> dict:
    """z-lab's config.json for the recipe's drafter of this target (target_cfg: transformers' dict)."""
    rope = dict(target_cfg["rope_parameters"])
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": r.hidden, "num_attention_heads": r.d_heads, "num_key_value_heads": r.d_kv_heads,
        "head_dim": r.d_head_dim, "intermediate_size": r.d_inter, "num_hidden_layers": r.d_layers,
        "num_target_layers": r.layers, "rms_norm_eps": 1e-5, "vocab_size": r.vocab,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "block_size": r.block,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": default_target_layer_ids(r.layers, r.taps)},
        "torch_dtype": "bfloat16",
    }


class TrainableDrafter(nn.Module):
    """Parameters named by core/weight_map.drafter_specs (our keys, '.' -> '__')."""

    def __init__(self, config: dict, target_hidden: int, seed: int):
        super().__init__()
        self.config = config
        self.cfg: DrafterConfig = parse_drafter_config(config)
        self.specs = drafter_specs(self.cfg, target_hidden)
        g = torch.Generator().manual_seed(seed)
        self.p = nn.ParameterDict({
            s.key.replace(".", "__"): nn.Parameter(torch.ones(s.shape) if len(s.shape) == 1
                                                   else torch.randn(s.shape, generator=g) * 0.02)
            for s in self.specs})
        self.rope = Rope(self.cfg.rope, self.cfg.head_dim, interleave=False)

    def w(self, key: str) -> torch.Tensor:
        return self.p[key.replace(".", "__")]

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, embed: torch.Tensor,
                lm_head: torch.Tensor) -> torch.Tensor:
        """feats [b, l, F], ids [b, l], anchors [b, k] (1 <= p <= l - s), embed / lm_head [v, H] (frozen)
        -> draft logits [b, k, D, v] for positions p + 1 .. p + D."""
        c = self.cfg
        b, l, _ = feats.shape
        k, s, e, eps = anchors.shape[1], c.block_size, c.head_dim, c.rms_norm_eps
        dev = feats.device
        self.rope.inv_freq = self.rope.inv_freq.to(dev)
        ctx = rms_norm(F.linear(feats, self.w("fc")), self.w("hidden_norm"), eps)  # [b, l, H]
        block = torch.full((b, k, s), c.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = ids.gather(1, anchors)
        x = F.embedding(block.view(b, k * s), embed)  # [b, k*s, H]
        ctx_pos = torch.arange(l, device=dev).expand(b, l)  # [b, l]
        blk_pos = (anchors[:, :, None] + torch.arange(s, device=dev)).view(b, k * s)  # [b, k*s]
        cos_c, sin_c = self.rope.cos_sin(ctx_pos, x.dtype)
        cos_b, sin_b = self.rope.cos_sin(blk_pos, x.dtype)
        sees_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(s, dim=1)[:, :, None]  # [b, k*s, l]: j < p
        blk_id = torch.arange(k, device=dev).repeat_interleave(s)  # [k*s]
        sees_blk = (blk_id[:, None] == blk_id[None, :]).expand(b, k * s, k * s)
        mask = torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]  # [b, 1, k*s, l + k*s]
        rep = c.num_heads // c.num_kv_heads
        for li in range(c.num_layers):
            p = f"layers.{li}."
            k_c, v_c = self._kv(p, ctx, cos_c, sin_c)  # [b, l, g, e]
            xn = rms_norm(x, self.w(p + "attn_norm"), eps)
            q = F.linear(xn, self.w(p + "q")).view(b, k * s, c.num_heads, e)
            q = self.rope.apply(rms_norm(q, self.w(p + "q_norm"), eps), cos_b, sin_b)  # [b, k*s, h, e]
            k_b, v_b = self._kv(p, xn, cos_b, sin_b)  # [b, k*s, g, e]
            keys = torch.cat([k_c, k_b], 1).repeat_interleave(rep, dim=2).transpose(1, 2)  # [b, h, l+k*s, e]
            vals = torch.cat([v_c, v_b], 1).repeat_interleave(rep, dim=2).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask,
                                                  scale=e ** -0.5)  # [b, h, k*s, e]
            x = x + F.linear(attn.transpose(1, 2).reshape(b, k * s, c.num_heads * e), self.w(p + "o"))
            hn = rms_norm(x, self.w(p + "mlp_norm"), eps)
            x = x + F.linear(F.silu(F.linear(hn, self.w(p + "gate"))) * F.linear(hn, self.w(p + "up")),
                             self.w(p + "down"))
        y = rms_norm(x.view(b, k, s, -1)[:, :, 1:], self.w("norm"), eps)  # [b, k, D, H]
        return F.linear(y, lm_head)

    def _kv(self, p: str, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        b, n, _ = x.shape
        k = F.linear(x, self.w(p + "k")).view(b, n, c.num_kv_heads, c.head_dim)
        v = F.linear(x, self.w(p + "v")).view(b, n, c.num_kv_heads, c.head_dim)
        return self.rope.apply(rms_norm(k, self.w(p + "k_norm"), c.rms_norm_eps), cos, sin), v


def sample_anchors(b: int, l: int, k: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """[b, k] distinct anchors per row in [1, l - s], sorted (seeded by gen)."""
    cand = l - s
    if cand < k:
        raise ValueError(f"{k} anchors of block {s} do not fit sequences of {l} tokens")
    return torch.stack([torch.randperm(cand, generator=gen)[:k] + 1 for _ in range(b)]).sort(dim=1).values


def dflash_loss(logits: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, weights: list[float]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-depth top-1 accuracy [D]) of logits [b, k, D, v] against ids [b, l]."""
    b, k, d, v = logits.shape
    pos = anchors[:, :, None] + torch.arange(1, d + 1, device=ids.device)  # [b, k, D]
    labels = ids.gather(1, pos.view(b, -1)).view(b, k, d)
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(b, k, d)
    w = torch.tensor(weights, device=logits.device)
    loss = (ce * w).sum(-1).mean() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, acc


def expected_chain_tau(acc_by_depth: torch.Tensor) -> float:
    """A rough chain-tau proxy from per-depth top-1 accuracies (independence assumed): 1 + sum of
    running products.  The real tau is measured through the Engine (training/measure.py)."""
    run, tau = 1.0, 1.0
    for a in acc_by_depth.tolist():
        run *= a
        tau += run
    return tau


def export_drafter(model: TrainableDrafter, out: str | Path, target_fingerprint: str | None = None) -> Path:
    """Write config.json + model.safetensors (bf16, z-lab's names) to `out`, atomically; target_fingerprint
    (core/fingerprint.py, of the target it was trained on) is recorded in dflash_config."""
    from safetensors.torch import save_file

    out = Path(out)
    tensors = {s.ckpt: model.w(s.key).detach().to("cpu", torch.bfloat16).contiguous() for s in model.specs}
    with staged_dir(out) as stage:
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        config = dict(model.config)
        if target_fingerprint is not None:
            config["dflash_config"] = {**config["dflash_config"], "target_fingerprint": target_fingerprint}
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

