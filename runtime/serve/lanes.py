"""Lanes: the slot batches (runtime/decode/slots.py) the scheduler fills, one per kind of request.

A lane is keyed by (spec mode, budget, auto, greedy): `max_batch` rows of one decode session, whose step is
captured once per greedy / sampled.  Requests of one spec share a lane, greedy ones one and sampled ones
another (each row samples from its own seed and temperature, so a seeded request draws the same numbers
as `kdtree run --seed` whatever else is running).  At most max_batch requests hold rows, so a lane
always has one free for the next.

LocalLanes builds them over the models of this process (Engine.load with tp 1).  RankLanes
(runtime/serve/ranks.py) keeps the same lanes inside `tp` rank processes.
"""

from __future__ import annotations

from pathlib import Path

from runtime.decode.graphs import GraphPool
from runtime.decode.params import SpecConfig
from runtime.decode.session import DecodeSession
from runtime.decode.slots import SlotBatch
from runtime.engine.engine import Engine

LaneKey = tuple[str, int, bool, bool]  # (mode, budget, auto, greedy)


def lane_key(spec: SpecConfig, greedy: bool) -> LaneKey:
    mode, budget = spec.bucket
    return mode, budget, spec.auto, greedy


def new_slot_batch(target, drafter, key: LaneKey, max_batch: int, capacity: int, pool: GraphPool | None,
                   graphs: bool, autotune_dir: str | Path | None = None) -> SlotBatch:
    """The slot batch of a lane (a decode session of its own: caches and buffers).  autotune_dir: where a
    budget-auto lane finds (or stores, once measured) its cost curve (ART/autotune)."""
    mode, budget, auto, greedy = key
    session = DecodeSession(target, drafter, SpecConfig(mode, max(budget, 1), auto), max_batch, capacity, pool,
                            autotune_dir=autotune_dir)
    return SlotBatch(session, greedy, graphs)


class LocalLanes:
    def __init__(self, engine: Engine, max_batch: int, capacity: int):
        """engine: a one-rank Engine; capacity: prompt + max_tokens of a request (--max-model-len)."""
        runner = engine.runner
        self.target, self.drafter = runner.target, runner.drafter
        self.max_batch, self.capacity, self.graphs = max_batch, capacity, runner.graphs
        self.autotune_dir = runner.autotune_dir
        self.pool = GraphPool(runner.device) if runner.graphs and runner.device.type == "cuda" else None
        self.lanes: dict[LaneKey, SlotBatch] = {}

    def get(self, key: LaneKey) -> SlotBatch:
        if key not in self.lanes:
            self.lanes[key] = new_slot_batch(self.target, self.drafter, key, self.max_batch, self.capacity,
                                             self.pool, self.graphs, self.autotune_dir)
        return self.lanes[key]

    def check(self) -> None:
        """Nothing to watch: the models live in this process."""

    def close(self) -> None:
        self.lanes.clear()
