"""tree_accept on the GPU: the Triton walk (CUDA-graph replay) against the reference incl. host copies.

    python3 benchmarks/tree_accept.py [--quick] [--out DIR]

Shapes: budget B in {16, 64, 256, 1024} (N = B + 1 nodes), depth 8 (a = 9), b in {1, 8, 64}; trees from
the tree_build reference on random draft logits, posterior planted along the path to a random node
(so accept lengths spread over 1..9).  Goal (issue 4): <= 5 µs for B = 256.
Bytes (minimal): read tokens, posterior (8 B) and parents (4 B) per node, write a * 4 + 4 + 8 B per
request; the roofline is nanoseconds, so the op is launch/latency-bound and the goal is absolute.

Timing: R = 32 calls captured in one CUDA graph, each on its own inputs and outputs (the pool of trees
rotated), µs = replay median / R: the op's cost inside a captured round, where it runs between other
kernels.  `us_one_call_graph` is a graph of one call (mostly the graph launch itself, ~5.8 µs on H200).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, roofline_us, time_us, write_result  # noqa: E402
from plugins.tree_accept import tree_accept  # noqa: E402
from plugins.tree_accept.kernel import tree_accept_triton  # noqa: E402
from plugins.tree_accept.reference import tree_accept_reference  # noqa: E402
from plugins.tree_build import build_from_topk_reference, topk_logprobs_reference  # noqa: E402

DEPTH = 8
R = 32  # calls per graph
POOL = 64  # distinct trees per budget; call k of R takes requests k * b, k * b + 1, ... (mod POOL)


def make_inputs(b: int, budget: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    vocab = max(2 * budget, 64)
    logits = torch.randn(b, DEPTH, vocab, generator=g) * 2
    lp, ids = topk_logprobs_reference(logits, min(budget, vocab))
    root = torch.randint(0, vocab, (b,), generator=g)
    tokens, parents, *_ = build_from_topk_reference(lp, ids, budget, root, torch.zeros(b, dtype=torch.long))
    post = torch.randint(0, vocab, tokens.shape, generator=g)
    for r in range(b):  # plant the target's choices along the path to a random node
        j = int(torch.randint(0, budget + 1, (1,), generator=g))
        while j > 0:
            post[r, int(parents[r, j])] = tokens[r, j]
            j = int(parents[r, j])
    return post.cuda(), tokens.cuda(), parents.cuda()


def reference_with_copies(post, tokens, parents, idx, length, bonus):
    """The peer: device-to-host copies, the Python walk, host-to-device copies of the results."""
    i, n, o = idx.cpu(), length.cpu(), bonus.cpu()
    tree_accept_reference(post.cpu(), tokens.cpu(), parents.cpu(), i, n, o)
    idx.copy_(i)
    length.copy_(n)
    bonus.copy_(o)
    torch.cuda.synchronize()


class Calls:
    """R independent calls for b requests: inputs taken from the pool, own outputs per call."""

    def __init__(self, pool, b: int, a: int):
        post, tokens, parents = pool
        self.inputs, self.outputs = [], []
        for k in range(R):
            rows = torch.arange(k * b, (k + 1) * b, device="cuda") % POOL
            self.inputs.append(tuple(t[rows].contiguous() for t in (post, tokens, parents)))
            self.outputs.append((torch.full((b, a), -1, dtype=torch.int32, device="cuda"),
                                 torch.zeros(b, dtype=torch.int32, device="cuda"),
                                 torch.zeros(b, dtype=torch.long, device="cuda")))

    def run(self, fn, **kw):
        def all_calls():
            for ins, outs in zip(self.inputs, self.outputs):
                fn(*ins, *outs, **kw)
        return all_calls

    def exact(self) -> tuple[bool, float]:
        """Every call's outputs against the reference (after a run); mean accept length."""
        ok, lens = True, []
        for ins, outs in zip(self.inputs, self.outputs):
            want = [torch.full(outs[0].shape, -1, dtype=torch.int32), torch.zeros(outs[1].shape, dtype=torch.int32),
                    torch.zeros(outs[2].shape, dtype=torch.long)]
            tree_accept_reference(*(t.cpu() for t in ins), *want)
            n = want[1]
            ok &= torch.equal(outs[1].cpu(), n) and torch.equal(outs[2].cpu(), want[2])
            got = outs[0].cpu()
            ok &= all(torch.equal(got[r, : n[r]], want[0][r, : n[r]]) for r in range(len(n)))
            lens.append(n.float())
        return ok, float(torch.cat(lens).mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = (16, 256) if args.quick else (16, 64, 256, 1024)
    batches = (1, 64) if args.quick else (1, 8, 64)
    rows, t_start = [], time.time()
    a = DEPTH + 1
    for budget in budgets:
        n = budget + 1
        pool = make_inputs(POOL, budget, seed=budget)
        for b in batches:
            calls = Calls(pool, b, a)
            calls.run(tree_accept)()  # the registered op
            torch.cuda.synchronize()
            exact, mean_len = calls.exact()
            us = time_us(calls.run(tree_accept), graph=True) / R
            ins, outs = calls.inputs[0], calls.outputs[0]
            us_one = time_us(lambda: tree_accept(*ins, *outs), graph=True)
            warps = {}
            if not args.quick:  # the num_warps heuristic against its neighbours
                for w in (1, 2, 4, 8, 16):
                    warps[w] = round(time_us(calls.run(tree_accept_triton, num_warps=w), graph=True) / R, 2)
            peer = time_us(lambda: reference_with_copies(*ins, *outs), warmup_ms=5, rep_ms=50)
            moved = b * n * (8 + 8 + 4) + b * (a * 4 + 4 + 8)
            roof = roofline_us(moved)
            rows.append(dict(B=budget, N=n, b=b, a=a, mean_accept_len=round(mean_len, 2), exact=exact,
                             us=round(us, 2), us_one_call_graph=round(us_one, 2), roofline_us=round(roof, 4),
                             roofline_fraction=round(roof / us, 5), bytes=moved,
                             goal_us=5.0 if budget == 256 else None, meets_goal=(us <= 5.0) if budget == 256 else None,
                             us_by_num_warps=warps, peer_reference_with_copies_us=round(peer, 1),
                             speedup_vs_reference=round(peer / us, 1)))
    path = write_result("tree_accept", rows, extra=dict(depth=DEPTH, calls_per_graph=R,
                                                        timing=f"CUDA-graph replay of {R} calls on rotated inputs, "
                                                               f"median / {R}; us_one_call_graph: one call per graph",
                                                        seconds=round(time.time() - t_start, 1)), out_dir=args.out)
    print(f"wrote {path}")
    print_table(rows, ["B", "b", "mean_accept_len", "exact", "us", "us_one_call_graph", "meets_goal",
                       "peer_reference_with_copies_us", "speedup_vs_reference", "us_by_num_warps"])

if __name__ == "__main__":
    main()
