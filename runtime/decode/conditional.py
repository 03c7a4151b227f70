"""Budget auto's captured round: a head graph and one body graph per bucket, composed into one CUDA graph.

torch 2.11 (the GPU machine's) cannot capture into a conditional node (CUDAGraph has no
begin_capture_to_if_node), so the pieces are captured by torch one by one (runtime/decode/graphs.py
capture_graph, keep_graph) and composed here through cuda-python's driver API:

  child(head: draft, tree_build, choice) -> kernel kdtree_set_switch(handle, choice.hot, nb)
      -> SWITCH h { 0: child(body 0) | 1: child(body 1) | ... | nb-1: child(body nb-1) }

one such graph per cap j (runtime/decode/budget.py: the tree built at bucket j), with head j and the
bodies of buckets 0..j; the host launches the cap's graph.  The setter kernel (plugins/graph_conditional)
writes the index of the device's one-hot choice into the handle (nb when none is hot: no body runs), so
exactly one body runs per replay (none when the choice is forced to "none") and the host never reads it.

Where the driver refuses a SWITCH node, or the cubin predates its setter, the same graph is composed of
one IF node per bucket instead (the first form, measured in budget-auto-rounds.json):

  child(head) -> kernel kdtree_set_conditionals(handles, choice.hot, nb)
      -> IF h_0 { child(body 0) } -> IF h_1 { child(body 1) } -> ... -> IF h_nb-1 { child(body nb-1) }

(CU_GRAPH_COND_ASSIGN_DEFAULT: each handle 0 at every launch unless set).  One SWITCH node is one
conditional node to schedule per replay instead of nb in a chain.

Memory: every piece is captured into the Engine's one graph pool.  The only tensors that cross pieces
are the session's persistent buffers (RoundBuffers, BucketChoice, the caches), so each capture's
intermediates are dead when it ends and the pieces may reuse each other's blocks: one head and at most
one body run per replay, in that order.  The torch graphs are kept alive with the composition (they own
those blocks); the child graph nodes hold copies of their nodes.

HostChoiceRound is the fallback where the composition is unavailable (no cuda-python, no setter kernel,
a driver without conditional nodes): the head's graph, then the host reads the choice (a sync), then
that bucket's graph.  Both launch on torch's current stream, as CapturedStep does.
"""

from __future__ import annotations

import ctypes

import torch

from plugins.common.driver import checked
from plugins.graph_conditional import KERNEL, SWITCH_KERNEL
from runtime.decode.graphs import GraphUnavailable


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


class ConditionalRound:
    """Heads (one per cap) and bodies (torch CUDAGraphs captured with keep_graph) composed with a SWITCH node (or
    IF nodes), one executable graph per cap (that cap's head, then the bodies of the buckets up to it); see the
    module doc."""

    def __init__(self, heads: dict[int, torch.cuda.CUDAGraph], bodies: list[torch.cuda.CUDAGraph], hot: torch.Tensor,
                 cubin: bytes, name: str, form: str = "switch"):
        """heads: cap (a bucket index) -> its head graph; hot [nb] bool on the device: the choice's one-hot
        (BucketChoice.hot), read by the setter kernel.  form: "switch" (one SWITCH node, IF nodes where refused)
        or "if" (IF nodes: the peer benchmarks/budget_auto_rounds.py measures beside it)."""
        if form not in ("switch", "if"):
            raise ValueError(f"ConditionalRound: form must be 'switch' or 'if', got {form!r}")
        cu = _driver()
        if cu is None:
            raise GraphUnavailable("conditional nodes need cuda-python (cuda.bindings) for the driver API")
        self.cu, self.name = cu, name
        self.pieces = [*heads.values(), *bodies]  # they own the pool's blocks the composed graphs use
        self.hot = hot
        self.module = self._ok(cu.cuModuleLoadData(cubin), "cuModuleLoadData (setter kernel)")
        self.func = self._ok(cu.cuModuleGetFunction(self.module, KERNEL), "cuModuleGetFunction")
        err, self.switch_func = cu.cuModuleGetFunction(self.module, SWITCH_KERNEL)
        self.ctx = self._ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.handles: dict[int, torch.Tensor] = {}  # cap -> [cap + 1] int64 its IF nodes' handles (the setter's)
        self.note = ""
        self.switch = form == "switch" and err == cu.CUresult.CUDA_SUCCESS
        if form == "switch" and not self.switch:
            self.note = "the setter cubin has no SWITCH setter (built before it): IF nodes"
        self.exec = {cap: self._compose(cap, head, bodies[:cap + 1]) for cap, head in heads.items()}
        self.full = max(heads)
        self._streams: dict[int, object] = {}
        self.via = "cuda-python (SWITCH node)" if self.switch else "cuda-python (IF nodes)"

    def _compose(self, cap: int, head: torch.cuda.CUDAGraph, bodies: list[torch.cuda.CUDAGraph]):
        if self.switch:
            try:
                return self._instantiate(cap, head, bodies, self._switch_nodes)
            except (GraphUnavailable, AttributeError, IndexError, TypeError) as e:  # a driver or bindings without
                # SWITCH nodes: the IF form (and no more tries)
                self.switch, self.note = False, f"SWITCH node refused ({type(e).__name__}: {e}): IF nodes"
        return self._instantiate(cap, head, bodies, self._if_nodes)

    def _instantiate(self, cap: int, head: torch.cuda.CUDAGraph, bodies: list[torch.cuda.CUDAGraph], conditional):
        """One executable graph: child(head) -> the setter kernel and conditional node(s) `conditional` adds."""
        cu = self.cu
        graph = self._ok(cu.cuGraphCreate(0), "cuGraphCreate")
        try:
            node = self._ok(cu.cuGraphAddChildGraphNode(graph, None, 0, cu.CUgraph(head.raw_cuda_graph())),
                            f"cuGraphAddChildGraphNode (head {cap})")
            conditional(graph, node, cap, bodies)
            return self._ok(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            cu.cuGraphDestroy(graph)  # the executable graph is independent of it

    def _setter(self, graph, node, func, threads: int, args: tuple, types: tuple, what: str):
        """The setter kernel's node (one block of `threads`) after `node`."""
        kp = self.cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = func
        kp.gridDimX, kp.gridDimY, kp.gridDimZ = 1, 1, 1
        kp.blockDimX, kp.blockDimY, kp.blockDimZ = threads, 1, 1
        kp.sharedMemBytes = 0
        kp.kernelParams = (args, types)
        return self._ok(self.cu.cuGraphAddKernelNode(graph, [node], 1, kp), f"cuGraphAddKernelNode ({what})")

    def _conditional(self, graph, node, handle, kind, size: int, bodies: list[torch.cuda.CUDAGraph], what: str):
        """A conditional node of `kind` after `node` whose branch i is child(bodies[i])."""
        cu = self.cu
        params = cu.CUgraphNodeParams()
        params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = kind
        params.conditional.size = size
        params.conditional.ctx = self.ctx
        node = self._ok(cu.cuGraphAddNode(graph, [node], None, 1, params), f"cuGraphAddNode ({what})")
        for i, body in enumerate(bodies):  # branch i: the node's i-th body graph, owned by the node
            inner = params.conditional.phGraph_out[i]
            self._ok(cu.cuGraphAddChildGraphNode(inner, None, 0, cu.CUgraph(body.raw_cuda_graph())),
                     f"cuGraphAddChildGraphNode ({what}, body {i})")
        return node

    def _switch_nodes(self, graph, node, cap: int, bodies: list[torch.cuda.CUDAGraph]) -> None:
        cu, nb = self.cu, len(bodies)
        handle = self._ok(cu.cuGraphConditionalHandleCreate(graph, self.ctx, nb, cu.CU_GRAPH_COND_ASSIGN_DEFAULT),
                          "cuGraphConditionalHandleCreate")  # default nb: no body unless set
        node = self._setter(graph, node, self.switch_func, 32, (int(handle), self.hot.data_ptr(), nb),
                            (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int), "SWITCH setter")
        self._conditional(graph, node, handle, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH, nb, bodies,
                          "SWITCH")

    def _if_nodes(self, graph, node, cap: int, bodies: list[torch.cuda.CUDAGraph]) -> None:
        cu, nb = self.cu, len(bodies)
        handles = [self._ok(cu.cuGraphConditionalHandleCreate(graph, self.ctx, 0, cu.CU_GRAPH_COND_ASSIGN_DEFAULT),
                            "cuGraphConditionalHandleCreate") for _ in range(nb)]
        self.handles[cap] = torch.tensor([int(h) for h in handles], dtype=torch.int64, device=self.hot.device)
        node = self._setter(graph, node, self.func, 32 * ((nb + 31) // 32),
                            (self.handles[cap].data_ptr(), self.hot.data_ptr(), nb),
                            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int), "IF setter")
        for i, (h, body) in enumerate(zip(handles, bodies)):
            node = self._conditional(graph, node, h, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF, 1, [body],
                                     f"IF {i}")

    def _ok(self, res, what: str):
        return checked(self.cu, res, f"composing {self.name}: {what}", GraphUnavailable)

    def launch(self, cap: int | None = None) -> None:
        """Enqueue one replay of cap's graph (None: the full tree) on torch's current stream (no host sync)."""
        ptr = torch.cuda.current_stream().cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self.cu.CUstream(ptr)
        self._ok(self.cu.cuGraphLaunch(self.exec[self.full if cap is None else cap], stream), "cuGraphLaunch")


class HostChoiceRound:
    """The fallback: cap's head graph, the host reads choice.pick (one sync), then that bucket's graph."""

    def __init__(self, heads: dict[int, torch.cuda.CUDAGraph], bodies: list[torch.cuda.CUDAGraph], pick: torch.Tensor,
                 note: str):
        self.heads, self.bodies, self.pick = heads, bodies, pick  # pick [] int64 on the device
        for g in (*heads.values(), *bodies):
            g.instantiate()
        self.full = max(heads)
        self.via = "torch (host reads the bucket)"
        self.note = note

    def launch(self, cap: int | None = None) -> None:
        self.heads[self.full if cap is None else cap].replay()
        i = int(self.pick.item())  # waits for the head
        if i < len(self.bodies):
            self.bodies[i].replay()
