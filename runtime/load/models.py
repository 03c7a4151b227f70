"""The one way a model is loaded, by every rank and every front door: `load_models`.

  checkpoint dir --(build_pipeline.build.ensure_built: the content-addressed build cache)--> artifact
  artifact --(rank r reads only rank{r}/ files: runtime/load/artifact.py)--> TargetWeights on the device
  + the drafter (the artifact's drafter/, or --drafter DIR) + the tokenizer (the artifact's tokenizer/)

A checkpoint dir is always taken through the build, so the weights are cut once, by
build_pipeline/shard.py, for every plan (tp 1 included); a second load is a cache hit.  The build
the runtime asks for compiles no kernels (archs none) and warms none: its CUDA C kernels then compile once
into the kdtree cache at first use (plugins/common/cubin.py; an artifact's own kernels/<arch>/ cubins are
checked and loaded instead), and Triton kernels come from an artifact's kernels/triton-<arch>/ only when
`kdtree build` warmed them on a GPU (runtime/load/kernel_cache.py), else they compile at first use.  Under
tensor parallelism the caller resolves the artifact once before starting ranks (`resolve_artifact`);
ranks that meet a checkpoint dir themselves (torchrun) let rank 0 build while the others wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline.artifact_cache import MANIFEST
from core.drafter_config import load_drafter_config
from core.errors import CheckpointError
from core.plan import ParallelPlan
from core.tokenizer import Tokenizer
from runtime.load.artifact import is_artifact, read_manifest, read_rank
from runtime.load.drafter import load_drafter
from runtime.load.kernel_cache import install_for_device, register_cuda_kernels
from runtime.model.drafter import DFlashDrafter
from runtime.model.target import TargetModel
from runtime.parallel.comm import Comm


@dataclass
class LoadedModels:
    target: TargetModel  # this rank's target
    drafter: DFlashDrafter | None
    tokenizer: Tokenizer | None  # None: the checkpoint had no tokenizer files (ids still decode)
    art_dir: Path  # the artifact the weights came from


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (the reference path), bf16 on CUDA."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def resolve_artifact(path: str | Path, plan: ParallelPlan | None, drafter_dir: str | Path | None = None,
                     progress: bool = False) -> tuple[Path, ParallelPlan]:
    """(artifact folder, its plan) for `path`: an artifact as is (its plan must equal `plan` when one
    is asked for), a checkpoint dir built through the cache for `plan` (default: one rank)."""
    path = Path(path)
    if (path / MANIFEST).is_file() and not (path / "config.json").is_file():
        read_manifest(path)  # an artifact whose manifest is damaged: say so, not "no config.json"
    if is_artifact(path):
        built = ParallelPlan.from_dict(read_manifest(path)["plan"])
        if plan is not None and plan != built:
            raise ValueError(f"{plan.flag()}: the artifact {path} was built with {built.flag()}")
        return path, built
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory or a kdtree artifact")
    from build_pipeline.build import build

    plan = plan or ParallelPlan()
    art = build(path, drafter_dir=drafter_dir, tp=plan.tp, ep=plan.ep, archs=(), progress=progress).art_dir
    return art, plan


def load_models(path: str | Path, comm: Comm | None = None, plan: ParallelPlan | None = None,
                drafter_dir: str | Path | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None, progress: bool = False) -> LoadedModels:
    """Rank comm.rank's target (one rank when comm is None), the drafter and the tokenizer.

    path: a `kdtree build` artifact or a checkpoint dir (built through the cache).  plan: the cut to
    use (default: the artifact's, or tp = the group's size with experts TP-sliced).  drafter_dir
    overrides the artifact's drafter.  device: with a comm, the comm's device.  Progress bars on
    rank 0 only."""
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    device = comm.device if comm is not None else torch.device(device)
    dtype = dtype or default_dtype(device)
    if plan is None and not is_artifact(path):
        plan = ParallelPlan(tp=world)
    staged = comm is not None and world > 1 and not is_artifact(path)  # rank 0 builds, the others then hit the cache
    if staged and rank != 0:
        comm.barrier()
    art, plan = resolve_artifact(path, plan, drafter_dir, progress and rank == 0)
    if staged and rank == 0:
        comm.barrier()
    if plan.tp != world:
        raise ValueError(f"--tp {world}: the artifact {art} was built with {plan.flag()}")
    manifest = read_manifest(art)  # read once for the kernels and the weights
    if torch.device(device).type == "cuda":  # the artifact's CUDA C cubins (moe_w4a16 v3, the budget-auto
        register_cuda_kernels(art, manifest)  # setter), before the weights' layout is chosen for them
    bundle = read_rank(art, rank, device, dtype, manifest)
    install_for_device(art, bundle.manifest, device)  # the artifact's Triton kernels, before any launch
    drafter_dir = drafter_dir or bundle.drafter_dir
    features = load_drafter_config(drafter_dir).target_layer_ids if drafter_dir is not None else ()
    target = TargetModel(bundle.cfg, bundle.weights, features, comm, plan)
    drafter = load_drafter(drafter_dir, target, progress=progress and rank == 0) if drafter_dir is not None else None
    return LoadedModels(target, drafter, load_tokenizer(art), art)


def load_tokenizer(art_dir: str | Path) -> Tokenizer | None:
    """The tokenizer an artifact carries (tokenizer/), or None when the checkpoint had none; a damaged
    one is a CheckpointError naming the file, never taken for "no tokenizer"."""
    d = Path(art_dir) / "tokenizer"
    if not any((d / name).is_file() for name in ("tiktoken.model", "tokenizer.json")):
        return None
    return Tokenizer.load(d)
