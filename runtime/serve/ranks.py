"""The server's lanes under tensor parallelism: each rank process keeps the same slot batches on its shard.

The rank processes are RanksRunner's (runtime/engine/ranks.py) with another body: instead of whole
generations (Engine.rounds) they take the scheduler's operations, sent to every rank:
("admit", key, (prompt, params)), ("prefill", key, row), ("step", key, None), ("release", key, row).
Every rank runs the operation on its own SlotBatch for `key` (the collectives inside the model keep
them in step); rank 0 answers all but release.  RankLane mirrors a slot batch's free, joining and
active rows on the front, so the scheduler drives LocalLanes and RankLanes alike.  A rank that dies
surfaces as RankFailure from the group (runtime/parallel/ranks.py): the scheduler's fatal path.
"""

from __future__ import annotations

from pathlib import Path

from core.config import ModelConfig
from core.errors import NonFiniteLogits
from core.plan import ParallelPlan
from runtime.decode.graphs import GraphPool
from runtime.decode.budget import AUTOTUNE_DIR
from runtime.decode.params import SpecConfig, parse_budget
from runtime.decode.slots import Prefilled, RowEmission
from runtime.engine.engine import Engine
from runtime.engine.ranks import RanksRunner
from runtime.load.artifact import read_manifest
from runtime.load.models import load_models, load_tokenizer, resolve_artifact
from runtime.parallel.comm import Comm
from runtime.parallel.ranks import RankGroup
from runtime.serve.lanes import LaneKey, new_slot_batch


def _rank_body(comm: Comm, conn, art_dir: str, plan: ParallelPlan, drafter, spec: SpecConfig | None, graphs: bool,
               dtype, max_batch: int, capacity: int, budget: int | str) -> None:
    models = load_models(art_dir, comm, plan, drafter, dtype=dtype)
    # no --spec: ddtree at the server's --budget with a drafter, else none (as Engine.load decides)
    spec = spec or (SpecConfig.of("ddtree", budget) if models.drafter is not None else SpecConfig("none"))
    autotune_dir = Path(art_dir) / AUTOTUNE_DIR
    dev = models.target.device
    pool = GraphPool(dev) if graphs and dev.type == "cuda" else None
    lanes = {}
    conn.send(("ready", (spec, models.drafter is not None)))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, key, arg = msg
        if key not in lanes:
            lanes[key] = new_slot_batch(models.target, models.drafter, key, max_batch, capacity, pool, graphs,
                                        autotune_dir)
        lane = lanes[key]
        if op == "release":
            lane.release(arg)
            continue
        try:
            calls = {"admit": lambda: lane.admit(*arg), "prefill": lambda: lane.prefill(arg), "step": lane.step}
            out = ("ok", calls[op]())
        except (ValueError, NonFiniteLogits) as exc:  # the same on every rank (the logits are gathered)
            out = ("bad" if isinstance(exc, ValueError) else "nonfinite", str(exc))
        if comm.rank == 0:
            conn.send((op, out))


class RankLane:
    """The front's view of one lane held by the ranks: the SlotBatch interface the scheduler uses."""

    def __init__(self, group: RankGroup, key: LaneKey, batch: int):
        self.group, self.key = group, key
        self.free = list(range(batch))
        self.active: set[int] = set()
        self.joining: set[int] = set()

    def _all(self, op: str, arg) -> None:
        for r in range(self.group.world):
            self.group.send(r, (op, self.key, arg))

    def _answer(self, op: str):
        for rank, kind, payload in self.group.messages():
            if rank == 0 and kind == op:
                return payload

    def _call(self, op: str, arg):
        self._all(op, arg)
        status, out = self._answer(op)
        if status != "ok":
            raise (ValueError if status == "bad" else NonFiniteLogits)(out)
        return out

    def admit(self, prompt: list[int], params) -> int:
        row = self._call("admit", (prompt, params))
        self.free.remove(row)
        self.joining.add(row)
        return row

    def prefill(self, row: int) -> Prefilled:
        try:
            done = self._call("prefill", row)
        except NonFiniteLogits:  # the ranks freed the row
            self.joining.discard(row)
            self.free.append(row)
            raise
        if done.first is not None:
            self.joining.discard(row)
            (self.active.add if done.live else self.free.append)(row)
        return done

    def step(self) -> list[RowEmission]:
        emitted = self._call("step", None)
        for e in emitted:
            if not e.live:  # finished, or its logits were non-finite: released on the ranks
                self.active.discard(e.row)
                self.free.append(e.row)
        return emitted

    def release(self, row: int) -> None:
        if row in self.active or row in self.joining:
            self._all("release", row)
            self.active.discard(row)
            self.joining.discard(row)
            self.free.append(row)


class RankLanes:
    def __init__(self, group: RankGroup, max_batch: int):
        self.group, self.max_batch = group, max_batch
        self.lanes: dict[LaneKey, RankLane] = {}

    def get(self, key: LaneKey) -> RankLane:
        if key not in self.lanes:
            self.lanes[key] = RankLane(self.group, key, self.max_batch)
        return self.lanes[key]

    def check(self) -> None:
        """Raise RankFailure if a rank process has exited (RankGroup.messages names it)."""
        if any(not p.is_alive() for p in self.group.procs):
            for _ in self.group.messages():
                pass

    def close(self) -> None:
        self.lanes.clear()


def load_ranks(path: str | Path, tp: int, device: str, drafter, spec: str | None, budget: int | str, graphs: bool,
               dtype, max_batch: int, max_model_len) -> tuple[Engine, RankLanes, int]:
    """Start `tp` rank processes holding the server's lanes -> (the Engine over them, its lanes,
    max_model_len resolved: a callable of the model's config)."""
    art, plan = resolve_artifact(path, ParallelPlan(tp=tp), drafter)
    cfg = ModelConfig.from_dict(read_manifest(art)["model"])
    capacity = max_model_len(cfg)
    want = None if spec is None else SpecConfig.of(spec, budget) if spec == "ddtree" \
        else SpecConfig(spec, parse_budget(budget)[0])
    runner = RanksRunner.start(art, cfg, plan, device, drafter, want, graphs, dtype, _rank_body,
                               (max_batch, capacity, budget))
    return Engine(runner, load_tokenizer(art)), RankLanes(runner.group, max_batch), capacity
