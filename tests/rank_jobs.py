"""Test helper: decode jobs on every rank of a launched group, through the Engine front door.

`generate_on_rank(comm, jobs)` is a runtime.parallel.ranks.launch worker: for each job this rank
loads its shard (Engine.on_rank -> runtime/load/models.load_models) and decodes the job's prompts;
every rank returns its own tokens, so a test can check that all ranks agree.  `run_job(job, None)`
is the one-process reference (the whole model, no collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.plan import ParallelPlan
from runtime.engine.engine import Engine
from runtime.parallel.comm import Comm


@dataclass(frozen=True)
class Job:
    """One model, one mode, a few prompts.  dtype: "float32" | "float64" | "bfloat16"."""

    path: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int = 16
    spec: str = "none"  # none | chain | ddtree
    budget: int = 16
    drafter: str | None = None
    ep: bool = False
    dtype: str = "float64"
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default=())


def run_job(job: Job, comm: Comm | None) -> list[list[int]]:
    """Decode job.prompts on this rank (comm None: one process, the whole model)."""
    drafter = job.drafter if job.spec != "none" else None
    dtype = getattr(torch, job.dtype)
    if comm is None:
        eng = Engine.load(job.path, drafter=drafter, spec=job.spec, budget=job.budget, dtype=dtype, graphs=False)
    else:
        plan = ParallelPlan(tp=comm.world, ep=job.ep)
        eng = Engine.on_rank(comm, job.path, drafter, job.spec, job.budget, graphs=False, plan=plan, dtype=dtype)
    return eng.generate_batch_ids([list(p) for p in job.prompts], job.max_new_tokens, job.temperature,
                                  list(job.stop_ids), job.seed)


def generate_on_rank(comm: Comm, jobs: list[Job]) -> list[list[list[int]]]:
    """Launcher worker: every job on this rank -> per job, per prompt, the new tokens."""
    return [run_job(job, comm) for job in jobs]
