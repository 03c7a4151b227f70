"""Load a DFlash drafter (z-lab's format) for a loaded target: config check, weights streamed to the
target's device and dtype, cut for this rank when it is sharded.  It shares the target's embedding
and lm_head (vocab-parallel under TP).

Sharded or replicated (runtime/model/drafter.py): under TP the drafter is sharded like the target
when its heads, kv heads, MLP width and feature width all divide by tp (the default), else
replicated.  Either way the tokens are the target's (DDTree is lossless); only the drafter's
rounding, hence at most the tree, differs."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from core.drafter_config import DrafterConfig, load_drafter_config
from core.fingerprint import FINGERPRINT_ROWS, embedding_fingerprint
from core.loader import WeightLoader
from core.progress import Progress
from core.weight_map import drafter_specs
from runtime.model.drafter import DFlashDrafter, DrafterLayerWeights, DrafterWeights
from runtime.model.target import TargetModel


def load_drafter(drafter_dir: str | Path, target: TargetModel, progress: bool = True,
                 shard: bool | None = None) -> DFlashDrafter:
    """The drafter of `drafter_dir` for `target` (which must return the drafter's target_layer_ids features).
    shard: cut it over the target's TP group (None: when it divides, see shardable)."""
    cfg = load_drafter_config(drafter_dir)
    cfg.check_target(target.cfg)
    if tuple(target.feature_layers) != cfg.target_layer_ids:
        raise ValueError(f"target returns features of layers {target.feature_layers}, drafter needs "
                         f"{cfg.target_layer_ids}")
    check_provenance(cfg, target, drafter_dir)
    loader = WeightLoader(drafter_dir)
    specs = drafter_specs(cfg, target.cfg.hidden_size)
    flat = {}
    bar = Progress(len(specs), "loading drafter", enabled=progress)
    for spec, t in loader.stream(specs, torch.float32):
        flat[spec.key] = t.to(device=target.device, dtype=target.dtype)
        bar.advance()
    bar.close()
    return assemble_drafter(cfg, flat, target, shard)


class DrafterProvenanceWarning(UserWarning):
    """The drafter records another target than the one it is loaded for (decoding stays lossless)."""


def check_provenance(cfg: DrafterConfig, target: TargetModel, drafter_dir: str | Path) -> str | None:
    """Warns (DrafterProvenanceWarning) when the drafter's recorded target fingerprint is not this target's;
    returns the fingerprint compared against, None when there is nothing to compare (no record, or a rank
    that does not hold the embedding's first rows)."""
    embed = target.w.embed  # [v_local, d]
    if cfg.target_fingerprint is None or (target.comm is not None and target.comm.rank != 0) \
            or embed.shape[0] < FINGERPRINT_ROWS:
        return None
    mine = embedding_fingerprint(embed)
    if mine != cfg.target_fingerprint:
        warnings.warn(f"drafter {drafter_dir} was built for another target (its dflash_config.target_fingerprint "
                      f"{cfg.target_fingerprint}, this target's {mine}): tokens stay the target's (lossless), "
                      f"but expect few accepted drafts", DrafterProvenanceWarning, stacklevel=3)
    return mine


def shardable(cfg: DrafterConfig, tp: int, target_hidden: int) -> bool:
    """The drafter divides evenly over tp ranks (query and kv heads, MLP width, feature columns)."""
    feats = len(cfg.target_layer_ids) * target_hidden
    return tp > 1 and all(n % tp == 0 for n in (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, feats))


def assemble_drafter(cfg: DrafterConfig, flat: dict[str, torch.Tensor], target: TargetModel,
                     shard: bool | None = None) -> DFlashDrafter:
    """DFlashDrafter from whole tensors {drafter_specs key: tensor}, cut to this rank's share when sharded
    (the whole tensors are dropped as they are cut)."""
    tp = target.plan.tp if target.comm is not None else 1
    can = shardable(cfg, tp, target.cfg.hidden_size)
    if shard and not can:
        raise ValueError(f"the drafter does not divide over {tp} ranks (heads {cfg.num_heads}, kv heads "
                         f"{cfg.num_kv_heads}, intermediate {cfg.intermediate_size})")
    shards = tp if (can if shard is None else shard) else 1
    rank = target.comm.rank if shards > 1 else 0
    e = cfg.head_dim

    def rows(key: str, n: int) -> torch.Tensor:  # this rank's n / shards rows of a [n, ...] tensor
        t = flat.pop(key)
        return t if shards == 1 else t.narrow(0, rank * (n // shards), n // shards).contiguous()

    def cols(key: str, n: int) -> torch.Tensor:  # this rank's n / shards columns of a [..., n] tensor
        t = flat.pop(key)
        return t if shards == 1 else t.narrow(1, rank * (n // shards), n // shards).contiguous()

    h, g, i = cfg.num_heads * e, cfg.num_kv_heads * e, cfg.intermediate_size
    layers = []
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        layers.append(DrafterLayerWeights(
            attn_norm=flat.pop(p + "attn_norm"), o=cols(p + "o", h), q_norm=flat.pop(p + "q_norm"),
            mlp_norm=flat.pop(p + "mlp_norm"),
            gate_up=torch.cat([rows(p + "gate", i), rows(p + "up", i)]), down=cols(p + "down", i)))
    fc = cols("fc", len(cfg.target_layer_ids) * target.cfg.hidden_size)
    # every layer's q | k | v rows in one tensor (DrafterWeights.qkv), filled piece by piece (no second copy)
    hl, gl = h // shards, g // shards
    qkv = fc.new_empty(cfg.num_layers, hl + 2 * gl, cfg.hidden_size)  # [layers, (h_l + 2*g_l)*e, H]
    k_norms = fc.new_empty(cfg.num_layers, e)  # [layers, e]
    for li in range(cfg.num_layers):
        for name, lo, n in (("q", 0, h), ("k", hl, g), ("v", hl + gl, g)):
            qkv[li, lo:lo + n // shards] = rows(f"layers.{li}.{name}", n)
        k_norms[li] = flat.pop(f"layers.{li}.k_norm")
    weights = DrafterWeights(fc=fc, hidden_norm=flat.pop("hidden_norm"), layers=layers, norm=flat.pop("norm"),
                             qkv=qkv, k_norms=k_norms, shards=shards)
    return DFlashDrafter(cfg, weights, target)
