"""RanksRunner: the decode rounds of a model cut over `tp` spawned rank processes.

This process (the front) keeps only the tokenizer and the config; each rank process loads its shard
through runtime/load/models.load_models and runs a LocalRunner on it.  Every request goes to all
ranks, which decode it SPMD (the collectives inside the model keep them in step; speculative
control runs on every rank from identical inputs, see runtime/model/target.py), and rank 0 streams
each round's tokens back.  A rank that fails at load or mid-run ends the request with RankFailure
naming it, and every rank is stopped (runtime/parallel/ranks.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from core.plan import ParallelPlan
from runtime.decode.budget import AUTOTUNE_DIR
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.engine.local import LocalRunner
from runtime.load.models import load_models
from runtime.parallel.comm import Comm
from runtime.parallel.ranks import RankGroup


def _serve(comm: Comm, conn, art_dir: str, plan: ParallelPlan, drafter, spec: SpecConfig | None, graphs: bool,
           dtype) -> None:
    """Rank body: load this rank's models, report ready, then run requests until the front sends None."""
    models = load_models(art_dir, comm, plan, drafter, dtype=dtype)
    spec = spec or SpecConfig("ddtree" if models.drafter is not None else "none")
    runner = LocalRunner(models.target, models.drafter, spec, graphs, autotune_dir=Path(art_dir) / AUTOTUNE_DIR)
    conn.send(("ready", (spec, models.drafter is not None)))
    while True:
        req = conn.recv()
        if req is None:
            return
        prompts, params = req
        for per_request in runner.rounds(prompts, params):
            if comm.rank == 0:
                conn.send(("round", per_request))
        conn.send(("done", runner.last_stats if comm.rank == 0 else None))


class RanksRunner:
    """The front's handle on `plan.tp` rank processes; the runner interface of LocalRunner."""

    def __init__(self, group: RankGroup, cfg, plan: ParallelPlan, spec: SpecConfig, has_drafter: bool, device):
        self.group, self.cfg, self.plan, self.spec = group, cfg, plan, spec
        self.has_drafter, self.device, self.graphs = has_drafter, torch.device(device), False
        self.dtype = None  # held by the ranks
        self.last_stats: dict = {}

    @classmethod
    def start(cls, art_dir: str | Path, cfg, plan: ParallelPlan, device: str, drafter, spec: SpecConfig | None,
              graphs: bool, dtype, entry=None, extra: tuple = ()) -> "RanksRunner":
        """entry(comm, conn, art_dir, plan, drafter, spec, graphs, dtype, *extra): the rank body (default
        _serve: Engine.rounds; runtime/serve/ranks.py has the server's slot batches); it sends ("ready",
        (spec, has_drafter)) once loaded."""
        args = (str(art_dir), plan, drafter, spec, graphs, dtype, *extra)
        group = RankGroup(entry or _serve, plan.tp, args, device)
        ready: dict[int, tuple] = {}
        try:
            for rank, kind, payload in group.messages_until(lambda: len(ready) == plan.tp):
                if kind == "ready":
                    ready[rank] = payload
        except BaseException:
            group.close()
            raise
        spec, has_drafter = ready[0]
        return cls(group, cfg, plan, spec, has_drafter, device)

    @property
    def plan_flag(self) -> str:
        return self.plan.flag()

    def configure(self, spec: SpecConfig, graphs: bool) -> "RanksRunner":
        raise ValueError(f"{self.plan.flag()}: reconfiguring a multi-rank engine is not supported; load another")

    def rounds(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[list[int]]]:
        for r in range(self.plan.tp):
            self.group.send(r, (prompts, params))
        done: set[int] = set()
        try:
            for rank, kind, payload in self.group.messages_until(lambda: len(done) == self.plan.tp):
                if kind == "round":
                    yield payload
                elif kind == "done":
                    done.add(rank)
                    if rank == 0:
                        self.last_stats = dict(payload, tp=self.plan.tp)
        finally:  # the consumer may stop early: let every rank finish the request before the next one
            pending = () if self.group.closed else self.group.messages_until(lambda: len(done) == self.plan.tp)
            for rank, kind, payload in pending:
                if kind == "done":
                    done.add(rank)

    def close(self) -> None:
        """Stop the ranks (also done at interpreter exit: the ranks are daemonic and die with us)."""
        if not self.group.closed:
            for r in range(self.plan.tp):
                try:
                    self.group.conns[r].send(None)
                except OSError:
                    pass
            self.group.close()
