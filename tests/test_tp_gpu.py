"""`--tp 1` under NCCL on one GPU: the collectives inside a captured CUDA graph, tokens unchanged.

1. an NCCL all_reduce / all_gather captured in a torch.cuda.CUDAGraph and replayed (new inputs each
   replay, results checked);
2. a rank Engine (TargetModel with a Comm: every collective of the TP path issued, world 1) decodes
   the tiny model, AR and DDTree, graphs on, and must give the tokens of the plain Engine; when the
   plain Engine captures its step, the TP one must too (the collectives are capturable).
With KDTREE_RESULTS_DIR set, writes tp-device-test.json there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from runtime.parallel.comm import Comm
from runtime.parallel.ranks import launch

pytestmark = pytest.mark.gpu


def _graph_collectives(comm: Comm) -> dict:
    """Capture all_reduce + all_gather on [n, 7168] bf16, replay with fresh inputs, check results."""
    dev = comm.device
    x = torch.empty(17, 7168, dtype=torch.bfloat16, device=dev)
    comm.all_reduce(x.normal_())  # warm-up outside capture (communicator, buffers)
    comm.all_gather(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        comm.all_reduce(x)
        y = x * 2
        gathered = comm.all_gather(y, dim=-1)
    torch.cuda.synchronize()
    worst = 0.0
    for i in range(5):
        src = torch.randn(17, 7168, device=dev).to(torch.bfloat16)
        x.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        expect = (src.float() * comm.world).to(torch.bfloat16) * 2  # world 1: the sum is the input
        worst = max(worst, (gathered.float() - expect.float().repeat(1, comm.world)).abs().max().item())
    return {"replays": 5, "max_abs_err": worst, "world": comm.world}


def _tokens_tp1(comm: Comm, path: str, drafter: str, prompt: list[int]) -> dict:
    from runtime.engine.engine import Engine

    out = {}
    for spec in ("none", "ddtree"):
        plain = Engine.load(path, device="cuda", drafter=drafter if spec != "none" else None, spec=spec, budget=16,
                            graphs=True)
        ref = list(plain.generate_ids(prompt, 24))
        ref_stats = plain.last_stats
        tp = Engine.on_rank(comm, path, drafter=drafter if spec != "none" else None, spec=spec, budget=16, graphs=True)
        got = list(tp.generate_ids(prompt, 24))
        out[spec] = {"ref": ref, "tp": got, "ref_graphs": ref_stats.get("graphs"),
                     "tp_graphs": tp.last_stats.get("graphs"), "tp_graph_note": tp.last_stats.get("graph_note")}
    return out


def _write(name: str, doc: dict) -> None:
    d = os.environ.get("KDTREE_RESULTS_DIR")
    if d:
        path = Path(d) / "tp-device-test.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        old[name] = doc
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(old, indent=1) + "\n")


def test_nccl_collectives_replay_in_a_cuda_graph():
    res = launch(_graph_collectives, 1, device="cuda")[0]
    _write("graph_collectives", res)
    assert res["max_abs_err"] == 0.0


def test_tp1_nccl_tokens_equal_plain_engine(tiny, tmp_path):
    from build_pipeline.tiny_drafter import make_tiny_drafter

    path = tiny.get("kimi")
    drafter = tmp_path / "drafter"
    make_tiny_drafter(path, drafter)
    res = launch(_tokens_tp1, 1, (path, str(drafter), [5, 6, 7, 8, 9]), device="cuda")[0]
    _write("tp1_tokens", res)
    for spec, r in res.items():
        assert r["tp"] == r["ref"], f"{spec}: --tp 1 under NCCL differs from the plain engine"
        if r["ref_graphs"]:
            assert r["tp_graphs"], f"{spec}: the TP step was not captured: {r['tp_graph_note']}"
