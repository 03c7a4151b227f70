"""CUDA graphs of the decode step, replayed through cuda-python.

A decode session (runtime/decode/session.py) captures its step function (a speculative round or an AR
step over persistent buffers, runtime/decode/round.py) once per bucket (mode, budget, batch, greedy or
sampled) and replays it every round.  All graphs of an Engine share one memory pool and one
capture stream (GraphPool): their intermediates are dead between replays, every result lands in
the session's persistent buffers.

Replay: torch hands out the instantiated cudaGraphExec_t (CUDAGraph.raw_cuda_graph_exec), which is
launched with cuda.bindings.runtime.cudaGraphLaunch on torch's current stream; where either is
missing, CUDAGraph.replay() does the same launch (the fallback is recorded in `via`).

Budget auto: the round's head and each bucket's body are captured here as separate graphs and
composed with conditional IF nodes by runtime/decode/conditional.py.

Not done: the device-side loop (a conditional WHILE node running rounds until every request has
stopped, shown to work on the H200 in DESIGN.md); the host launches one graph per round and reads
the emitted tokens back one round behind (session.py), which keeps the GPU busy as long as the
host's work per round is shorter than a round.
"""

from __future__ import annotations

from typing import Callable

import torch

# the ops of a round; each needs a CUDA kernel (the references synchronise with the host)
ROUND_OPS = ("kdtree::tree_build", "kdtree::tree_accept", "kdtree::kv_commit", "kdtree::round_emit",
             "kdtree::tree_verify_mla", "kdtree::moe_w4a16", "kdtree::posterior", "kdtree::vocab_argmax_local",
             "kdtree::vocab_argmax_pick")


class GraphUnavailable(RuntimeError):
    """The step cannot be captured on this setup (no CUDA kernel for an op, capture failed)."""


def missing_cuda_kernels(ops: tuple[str, ...] = ROUND_OPS) -> list[str]:
    """The ops among `ops` without a CUDA kernel (they would run the host-syncing reference)."""
    missing = []
    for op in ops:
        try:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"):
                missing.append(op)
        except RuntimeError:  # op not registered at all
            missing.append(op)
    return missing


def _cuda_runtime():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    return cudart


class GraphPool:
    """The memory pool and capture stream shared by an Engine's graphs."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        self.cudart = _cuda_runtime()


def capture_graph(fn: Callable[[], None], pool: GraphPool, name: str, warmup: int = 2,
                  keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """fn() captured into a torch CUDAGraph on the pool's stream and memory pool, after `warmup` eager calls of
    fn on the capture stream (lazy init: Triton compiles, cuBLAS handles, outside the capture).
    keep_graph: keep the cudaGraph_t (raw_cuda_graph())
    for composing (runtime/decode/conditional.py) instead of instantiating it."""
    stream = pool.stream
    stream.wait_stream(torch.cuda.current_stream(pool.device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(pool.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph) if keep_graph else torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(pool.device)
    try:
        with torch.cuda.graph(graph, pool=pool.pool, stream=stream):
            fn()
    except Exception as exc:  # a host sync or an allocation the capture refused
        # when capture_end raises, torch.cuda.graph's exit leaves the capture stream current: every later
        # op (and capture) of the process would run on it
        torch.cuda.set_stream(current)
        raise GraphUnavailable(f"capturing {name} failed: {type(exc).__name__}: {exc}") from exc
    return graph


class CapturedStep:
    """fn() captured into one CUDA graph (capture_graph) and launched through cuda-python."""

    def __init__(self, fn: Callable[[], None], pool: GraphPool, warmup: int = 2, name: str = "step"):
        self.name = name
        self.graph = capture_graph(fn, pool, name, warmup)
        self.cudart = pool.cudart
        self.exec_handle = None
        self.note = ""
        if self.cudart is None:
            self.note = "cuda-python (cuda.bindings) not importable: replaying with CUDAGraph.replay()"
        elif not hasattr(self.graph, "raw_cuda_graph_exec"):
            self.note = f"torch {torch.__version__} lacks CUDAGraph.raw_cuda_graph_exec: replaying with replay()"
        else:
            self.exec_handle = self.cudart.cudaGraphExec_t(init_value=int(self.graph.raw_cuda_graph_exec()))
        self._streams: dict[int, object] = {}
        self.via = "cuda-python" if self.exec_handle is not None else "torch"

    def launch(self) -> None:
        """Enqueue one replay on torch's current stream (no host sync)."""
        if self.exec_handle is None:
            self.graph.replay()
            return
        ptr = torch.cuda.current_stream().cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self.cudart.cudaStream_t(init_value=ptr)
        res = self.cudart.cudaGraphLaunch(self.exec_handle, stream)
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"cudaGraphLaunch of {self.name} failed: {err}")
