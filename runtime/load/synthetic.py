"""A synthetic rank drawn straight into memory: `kdtree build --synthetic`'s weights without the disk.

A K2.6 TP8 rank is ~76 GB: the GPU machine's 64 GiB disk and 128 GiB RAM cannot hold it as files
plus page cache, so the full-depth rank is drawn file by file on the device by the same code that
writes the artifact (build_pipeline/synthetic.rank_files) and grouped by the same functions that read
it (runtime/load/artifact.place / assemble_weights).  With the same seed, preset, plan and draw
device, the tensors equal those of the artifact `kdtree build --synthetic ... --device D` writes
(tests/test_synthetic.py checks it at reduced depth on the GPU).  The drafter is the preset's DFlash
geometry with random weights (build_pipeline/synthetic.drafter_tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from build_pipeline.synthetic import drafter_config, drafter_tensors, preset_config, rank_files
from core.config import ModelConfig
from core.plan import ParallelPlan
from core.progress import Progress
from runtime.load.artifact import assemble_weights, place
from runtime.load.drafter import assemble_drafter
from runtime.model.drafter import DFlashDrafter
from runtime.model.target import TargetModel
from runtime.model.weights import TargetWeights
from runtime.parallel.comm import Comm


@dataclass
class DrawnRank:
    cfg: ModelConfig
    plan: ParallelPlan
    weights: TargetWeights


def draw_rank(preset: str, tp: int, rank: int, layers: int | None = None, seed: int = 0,
              device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
              progress: bool = False) -> DrawnRank:
    """Rank `rank` of a tp-way plan of `preset`, drawn on `device` file by file (peak: one layer on top of
    the rank's weights)."""
    cfg, depth = preset_config(preset, layers)
    plan = ParallelPlan(tp=tp)
    plan.validate(cfg)
    flat: dict[str, torch.Tensor] = {}
    bar = Progress(cfg.num_layers + 1, "drawing synthetic rank", enabled=progress)
    for _, tensors in rank_files(cfg, depth, plan, rank, seed, device):
        for name in list(tensors):
            flat[name] = place(name, tensors.pop(name), device, dtype)
        bar.advance()
    bar.close()
    return DrawnRank(cfg, plan, assemble_weights(cfg, flat))


def draw_models(preset: str, comm: Comm | None, layers: int | None = None, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                shard_drafter: bool | None = None, progress: bool = False) -> tuple[TargetModel, DFlashDrafter]:
    """(target rank comm.rank of a comm.world-way plan, its DFlash drafter) of `preset` with random
    weights on comm.device (`device` when comm is None: one whole rank).  shard_drafter: see
    runtime/load/drafter.assemble_drafter."""
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    device = comm.device if comm is not None else torch.device(device)
    drawn = draw_rank(preset, world, rank, layers, seed, device, dtype, progress)
    dcfg = drafter_config(preset, drawn.cfg.num_layers)
    target = TargetModel(drawn.cfg, drawn.weights, dcfg.target_layer_ids, comm, drawn.plan)
    return target, draw_drafter(preset, target, seed, shard_drafter)


def draw_drafter(preset: str, target: TargetModel, seed: int = 0, shard: bool | None = None) -> DFlashDrafter:
    """The preset's DFlash drafter with random weights for `target` (drawn whole on its device, then cut for
    its rank when sharded; shard None: when it divides)."""
    dcfg = drafter_config(preset, target.cfg.num_layers)
    flat = {k: t.to(target.dtype) for k, t in drafter_tensors(dcfg, target.cfg.hidden_size, seed,
                                                               target.device).items()}
    return assemble_drafter(dcfg, flat, target, shard)
