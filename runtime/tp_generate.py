"""Batch generation on every rank of a tensor-parallel group (tests, benchmarks, `Engine` followers).

`generate_on_rank(comm, jobs)` is a launcher worker (runtime/dist.launch): each job loads this rank's
models, decodes its prompts (plain AR or speculative: generate_ar_batch / generate_spec_batch, i.e.
the Engine's DecodeSession run eagerly) and returns the tokens.  Every rank returns its own tokens,
so a caller can check that all ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from build_pipeline.plan import ParallelPlan
from runtime.dist import Comm


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
    from runtime.generate import SamplingParams, generate_ar_batch
    from runtime.rank_model import load_rank_models
    from runtime.spec import SpecConfig, generate_spec_batch

    world = comm.world if comm is not None else 1
    plan = ParallelPlan(tp=world, ep=job.ep)
    target, drafter = load_rank_models(job.path, comm, plan, job.drafter if job.spec != "none" else None,
                                       dtype=getattr(torch, job.dtype), progress=False)
    params = SamplingParams(job.max_new_tokens, job.temperature, job.seed, job.stop_ids)
    prompts = [list(p) for p in job.prompts]
    if job.spec == "none":
        return generate_ar_batch(target, prompts, params)
    return generate_spec_batch(target, drafter, prompts, params, SpecConfig(job.spec, job.budget))


def generate_on_rank(comm: Comm, jobs: list[Job]) -> list[list[list[int]]]:
    """Launcher worker: every job on this rank -> per job, per prompt, the new tokens."""
    return [run_job(job, comm) for job in jobs]

