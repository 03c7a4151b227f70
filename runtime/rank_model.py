"""Load one rank's target (and the replicated drafter) for a tensor-parallel run.

`path` is a `kdtree build` artifact (each rank reads only its own shard: runtime/artifact.load_rank;
the plan comes from its manifest) or a model directory (every rank reads the checkpoint and keeps its
slice: runtime/shard_weights.py).  The drafter is small and replicated: every rank runs it on the same
inputs and gets the same draft, so tree_build sees identical logits everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from build_pipeline.plan import ParallelPlan
from runtime.dist import Comm
from runtime.model import TargetModel


def load_rank_models(path: str | Path, comm: Comm | None, plan: ParallelPlan | None = None,
                     drafter_dir: str | Path | None = None, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, progress: bool = True):
    """-> (target TargetModel, drafter DFlashDrafter or None) of rank comm.rank under `plan`
    (default: tp = comm.world, experts TP-sliced).  Progress bars only on rank 0."""
    from build_pipeline.config import load_config
    from build_pipeline.drafter_config import load_drafter_config
    from runtime.artifact import is_artifact, load_rank
    from runtime.drafter import load_drafter
    from runtime.shard_weights import shard_target_weights
    from runtime.weights import load_target_weights

    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    progress = progress and rank == 0
    device = comm.device if comm is not None else torch.device(device)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if is_artifact(path):
        bundle = load_rank(path, rank, device, dtype)
        if plan is not None and plan != bundle.plan:
            raise ValueError(f"{plan.flag()}: the artifact {path} was built with {bundle.plan.flag()}")
        if bundle.plan.tp != world:
            raise ValueError(f"--tp {world}: the artifact {path} was built with {bundle.plan.flag()}")
        cfg, plan, weights = bundle.cfg, bundle.plan, bundle.weights
        drafter_dir = drafter_dir or bundle.drafter_dir
    else:
        plan = plan or ParallelPlan(tp=world)
        if plan.tp != world:
            raise ValueError(f"{plan.flag()}: the group has {world} ranks")
        cfg = load_config(path)
        plan.validate(cfg)
        full = load_target_weights(path, cfg, dtype, device, progress)
        weights = shard_target_weights(cfg, plan, full, rank)
        del full
    features = load_drafter_config(drafter_dir).target_layer_ids if drafter_dir is not None else ()
    target = TargetModel(cfg, weights, features, comm, plan)
    drafter = load_drafter(drafter_dir, target, progress=progress) if drafter_dir is not None else None
    return target, drafter
