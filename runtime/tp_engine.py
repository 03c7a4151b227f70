"""The multi-rank Engine: `Engine.load(path, tp=N)` / `kdtree run --tp N`.

Layout: this process keeps only the tokenizer and the config (the front); N spawned ranks
(runtime/dist.RankGroup) each hold a rank Engine on its own shard (runtime/rank_model.py) and run
every request SPMD: the front sends the request to all ranks, every rank decodes it (the collectives
inside the model keep them in step), and rank 0 streams each round's tokens back.  Speculative
control (tree_build, tree_accept, kv_commit, sampling) runs on every rank from identical inputs, see
runtime/model.py.  A rank that fails at load or mid-run ends the request with RankFailure naming it,
and every rank is stopped.

Under torchrun there is no front: each process is one rank (`rank_engine`), and only rank 0 prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from build_pipeline.errors import CheckpointError
from runtime.dist import Comm, RankGroup
from runtime.engine import Engine, check_decode_args
from runtime.tokenizer import Tokenizer


def rank_engine(comm: Comm, path, drafter, spec, budget, graphs, dtype, ep: bool = False,
                tokenizer: bool = False) -> Engine:
    """This rank's Engine over its shard (its `rank` attribute is comm.rank).  ep: routed experts
    whole per rank (else the default plan: TP-sliced, or an artifact's own plan)."""
    from build_pipeline.plan import ParallelPlan
    from runtime.rank_model import load_rank_models

    plan = ParallelPlan(tp=comm.world, ep=True) if ep else None
    target, drafter_model = load_rank_models(path, comm, plan, drafter, comm.device, dtype, progress=False)
    spec = spec or ("ddtree" if drafter_model is not None else "none")
    eng = Engine(target, drafter_model if spec != "none" else None, _tokenizer(path) if tokenizer else None, spec,
                 budget, graphs)
    eng.rank = comm.rank
    return eng


def _serve(comm: Comm, conn, path, drafter, spec, budget, graphs, dtype, ep) -> None:
    """Rank body: load, report ready, then run requests until the front sends None."""
    eng = rank_engine(comm, path, drafter, spec, budget, graphs, dtype, ep)
    conn.send(("ready", eng.spec))
    while True:
        req = conn.recv()
        if req is None:
            return
        prompts, max_new_tokens, temperature, stop_ids, seed = req
        for per_request in eng._rounds(prompts, max_new_tokens, temperature, list(stop_ids), seed):
            if comm.rank == 0:
                conn.send(("round", per_request))
        conn.send(("done", eng.last_stats if comm.rank == 0 else None))


class _TargetFront:
    """What the front knows of the target: its config (encode / stop_ids read it)."""

    def __init__(self, cfg):
        self.cfg, self.device = cfg, torch.device("cpu")


class TPEngine(Engine):
    """Engine front over `tp` spawned ranks; the generation API is Engine's."""

    @classmethod
    def start(cls, path, device: str, drafter, spec: str | None, budget: int, graphs: bool, tp: int,
              dtype: torch.dtype | None, ep: bool = False) -> "TPEngine":
        from runtime.artifact import is_artifact, read_manifest

        path = Path(path)
        if is_artifact(path):
            from build_pipeline.config import ModelConfig
            cfg = ModelConfig.from_dict(read_manifest(path)["model"])
        else:
            from build_pipeline.config import load_config
            cfg = load_config(path)
        group = RankGroup(_serve, tp, (str(path), drafter, spec, budget, graphs, dtype, ep), device)
        ready: dict[int, str] = {}
        try:
            for rank, kind, payload in group.messages_until(lambda: len(ready) == tp):
                if kind == "ready":
                    ready[rank] = payload
        except BaseException:
            group.close()
            raise
        return cls(group, cfg, _tokenizer(path), ready[0], budget, tp)

    def __init__(self, group: RankGroup, cfg, tokenizer, spec: str, budget: int, tp: int):
        super().__init__(_TargetFront(cfg), object() if spec != "none" else None, tokenizer, spec, budget,
                         graphs=False)
        self.group, self.tp, self.rank = group, tp, 0

    def configure(self, spec=None, budget=None, graphs=None) -> "Engine":
        raise ValueError(f"--tp {self.tp}: reconfiguring a multi-rank engine is not supported; load another")

    def _rounds(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                stop: Sequence[int | str] | None, seed: int | None) -> Iterator[list[list[int]]]:
        check_decode_args(max_new_tokens, temperature)
        ids, _ = self.stop_ids(stop)
        req = (prompts, max_new_tokens, temperature, tuple(ids), seed)
        for r in range(self.tp):
            self.group.send(r, req)
        done: set[int] = set()
        try:
            for rank, kind, payload in self.group.messages_until(lambda: len(done) == self.tp):
                if kind == "round":
                    yield payload
                elif kind == "done":
                    done.add(rank)
                    if rank == 0:
                        self.last_stats = dict(payload, tp=self.tp)
        finally:  # the consumer may stop early: let every rank finish the request before the next one
            pending = () if self.group.closed else self.group.messages_until(lambda: len(done) == self.tp)
            for rank, kind, payload in pending:
                if kind == "done":
                    done.add(rank)

    def close(self) -> None:
        """Stop the ranks (also done at interpreter exit: the ranks are daemonic and die with us)."""
        if not self.group.closed:
            for r in range(self.tp):
                try:
                    self.group.conns[r].send(None)
                except OSError:
                    pass
            self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tokenizer(path) -> Tokenizer | None:
    from runtime.artifact import is_artifact

    tok_dir = Path(path) / "tokenizer" if is_artifact(path) else Path(path)
    try:
        return Tokenizer.load(tok_dir)
    except CheckpointError:
        return None
