"""LocalRunner: the decode sessions of models loaded in this process (one rank, or one rank of a group).

Sessions are kept per (mode, budget, auto, batch) bucket and grown by powers of two, so their CUDA graphs
(one per bucket and greedy/sampled, runtime/decode/graphs.py) are captured once and replayed; all
of a runner's graphs share one memory pool.  `configure` returns a runner over the same models,
sessions and pool with other options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from runtime.decode.graphs import GraphPool
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.decode.session import DecodeSession
from runtime.decode.stats import DecodeStats
from runtime.model.drafter import DFlashDrafter
from runtime.model.target import TargetModel

MIN_CAPACITY = 512  # tokens per request of the smallest graph-captured session


class LocalRunner:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, spec: SpecConfig, graphs: bool,
                 sessions: dict | None = None, pool: GraphPool | None = None, autotune_dir: str | Path | None = None):
        """autotune_dir: where budget-auto sessions store and find measured cost curves (ART/autotune)."""
        if spec.mode != "none" and drafter is None:
            raise ValueError(f"spec {spec.mode!r} needs a drafter (drafter=DIR, or an artifact built with --drafter)")
        self.target, self.drafter, self.spec, self.graphs = target, drafter, spec, graphs
        self.device, self.dtype, self.cfg = target.device, target.dtype, target.cfg
        self._sessions = sessions if sessions is not None else {}
        self._pool = pool
        self.autotune_dir = autotune_dir
        if graphs and self.device.type == "cuda" and self._pool is None:
            self._pool = GraphPool(self.device)
        self.last_stats: dict = {}

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    @property
    def plan_flag(self) -> str:
        return self.target.plan.flag()

    def configure(self, spec: SpecConfig, graphs: bool) -> "LocalRunner":
        return LocalRunner(self.target, self.drafter, spec, graphs, self._sessions, self._pool, self.autotune_dir)

    def rounds(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[list[int]]]:
        """Per round, the tokens each request emits (the first token of each in the first yield)."""
        stats = DecodeStats(prompt_tokens=sum(len(p) for p in prompts))
        stats.extra.update(spec=self.spec.mode, budget=self.spec.budget_label if self.spec.mode == "ddtree" else None,
                           device=str(self.device), batch=len(prompts), plan=self.plan_flag)
        self.last_stats = stats.as_dict()
        if params.max_new_tokens == 0:
            return
        session = self._session(len(prompts), max(len(p) for p in prompts) + params.max_new_tokens,
                                len(params.stop_ids))
        try:
            yield from session.rounds(prompts, params, self.graphs, stats)
        finally:
            self.last_stats = stats.as_dict()

    def _session(self, batch: int, need: int, stops: int) -> DecodeSession:
        key = (*self.spec.key, batch)
        s = self._sessions.get(key)
        if s is None or s.capacity < need or s.max_stops < stops:
            # captured graphs bake buffer addresses in: powers of two, few re-allocations and re-captures;
            # eager (CPU) sessions exactly as large as asked (the reference attends over the capacity)
            capacity = max(MIN_CAPACITY, 1 << (need - 1).bit_length()) if self._pool is not None else need
            max_stops = max(16, stops, s.max_stops if s is not None else 0)
            s = self._sessions[key] = DecodeSession(self.target, self.drafter, self.spec, batch, capacity, self._pool,
                                                    max_stops=max_stops, autotune_dir=self.autotune_dir)
        return s
