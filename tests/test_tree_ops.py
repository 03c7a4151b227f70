"""tree_build against brute-force enumeration of all prefixes (ties included), tree_accept's walk,
kv_commit's compaction, and the bitmask helpers."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from plugins.common.bitmask import causal_mask, pack_mask, unpack_mask
from plugins.kv_commit import kv_commit
from plugins.tree_accept import tree_accept
from plugins.tree_build import build_from_topk_reference, topk_logprobs_reference, tree_build


def brute_force_tree(lp: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """All rank tuples up to depth D, scored by left-to-right fp32 sums, sorted by (-score, depth, ranks)."""
    depth, k = lp.shape
    keyed = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = np.float32(0.0)
            for level, r in enumerate(ranks):
                s = np.float32(s + lp[level, r])
            keyed.append((-float(s), d, ranks))
    keyed.sort()
    return [ranks for _, _, ranks in keyed[:budget]]


def _random_lp(rng: random.Random, depth: int, k: int, ties: bool) -> np.ndarray:
    if ties:  # few distinct values: many exactly equal scores
        rows = [sorted((-rng.choice([0.25, 0.5, 0.5, 1.0, 2.0]) for _ in range(k)), reverse=True) for _ in range(depth)]
        rows = [[0.0 if rng.random() < 0.1 else v for v in row] for row in rows]
        rows = [sorted(row, reverse=True) for row in rows]
    else:
        rows = [sorted((-rng.expovariate(1.0) for _ in range(k)), reverse=True) for _ in range(depth)]
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("case", range(300))
def test_tree_build_is_the_brute_force_best_prefixes(case):
    rng = random.Random(case)
    depth, k = rng.randint(1, 4), rng.randint(1, 4)
    total = sum(k ** d for d in range(1, depth + 1))
    budget = rng.randint(1, total)
    lp = _random_lp(rng, depth, k, ties=case % 2 == 0)
    ids = torch.tensor([[rng.sample(range(50), k) for _ in range(depth)]])  # distinct tokens per depth
    root, start = torch.tensor([7]), torch.tensor([100])
    tokens, parents, dep, positions, mask, _ = build_from_topk_reference(torch.from_numpy(lp)[None], ids, budget,
                                                                         root, start)
    expect = brute_force_tree(lp, budget)
    index = {ranks: i + 1 for i, ranks in enumerate(expect)}
    assert tokens[0, 0] == 7 and parents[0, 0] == -1 and dep[0, 0] == 0
    for i, ranks in enumerate(expect, start=1):
        d = len(ranks)
        assert dep[0, i] == d and positions[0, i] == 100 + d
        assert tokens[0, i] == ids[0, d - 1, ranks[-1]]
        assert parents[0, i] == (index[ranks[:-1]] if d > 1 else 0)
        assert parents[0, i] < i
    dense = unpack_mask(mask, budget + 1)[0]
    for i in range(budget + 1):  # each node sees exactly itself and its ancestors
        anc, j = {i}, i
        while j > 0:
            j = int(parents[0, j])
            anc.add(j)
        assert set(torch.nonzero(dense[i]).flatten().tolist()) == anc


def test_topk_logprobs_order_ties_by_token_id_and_lse():
    logits = torch.tensor([[[1.0, 3.0, 3.0, -2.0, 3.0, 0.5]]])
    lp, ids = topk_logprobs_reference(logits, 4)
    assert ids.tolist() == [[[1, 2, 4, 0]]]
    lse = torch.logsumexp(logits.double(), -1).float()
    assert torch.equal(lp, (logits - lse[..., None]).gather(-1, ids))


def test_tree_build_op_batched_and_chain():
    g = torch.Generator().manual_seed(0)
    b, depth, vocab, budget = 3, 5, 40, 12
    logits = torch.randn(b, depth, vocab, generator=g)
    root, start = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    n = budget + 1
    outs = [torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n, dtype=torch.int32),
            torch.zeros(b, n, dtype=torch.int32), torch.zeros(b, n, dtype=torch.long),
            torch.zeros(b, n, 1, dtype=torch.int64)]
    tree_build(logits, root, start, budget, *outs)
    for r in range(b):
        lp, ids = topk_logprobs_reference(logits[r:r + 1], budget)
        single = build_from_topk_reference(lp, ids, budget, root[r:r + 1], start[r:r + 1])
        for got, want in zip(outs, single):
            assert torch.equal(got[r], want[0])
    chain = [torch.zeros(b, depth + 1, dtype=torch.long), torch.zeros(b, depth + 1, dtype=torch.int32),
             torch.zeros(b, depth + 1, dtype=torch.int32), torch.zeros(b, depth + 1, dtype=torch.long),
             torch.zeros(b, depth + 1, 1, dtype=torch.int64)]
    tree_build(logits, root, start, 1, *chain)
    assert torch.equal(chain[1][0], torch.arange(-1, depth, dtype=torch.int32))
    assert torch.equal(chain[0][:, 1:], logits.argmax(-1))
    assert torch.equal(chain[4], causal_mask(b, depth + 1))


def test_tree_accept_walks_the_target_choices():
    # tree: 0 -> {1: tok 5, 2: tok 6}; 1 -> {3: tok 7}; 2 -> {4: tok 8}; 3 -> {5: tok 9}
    tokens = torch.tensor([[4, 5, 6, 7, 8, 9]] * 3)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * 3, dtype=torch.int32)
    posterior = torch.tensor([[6, 0, 8, 0, 11, 0],  # 0 -> 2 -> 4, then bonus 11
                              [5, 7, 0, 9, 0, 12],  # 0 -> 1 -> 3 -> 5, bonus 12
                              [13, 0, 0, 0, 0, 0]])  # nothing matches: bonus 13
    idx = torch.full((3, 4), -1, dtype=torch.int32)
    length = torch.zeros(3, dtype=torch.int32)
    bonus = torch.zeros(3, dtype=torch.long)
    tree_accept(posterior, tokens, parents, idx, length, bonus)
    assert length.tolist() == [3, 4, 1] and bonus.tolist() == [11, 12, 13]
    assert idx[0, :3].tolist() == [0, 2, 4] and idx[1].tolist() == [0, 1, 3, 5] and idx[2, 0] == 0


def test_kv_commit_appends_accepted_rows_and_features():
    g = torch.Generator().manual_seed(3)
    y, b, cap, n, dqk, f = 2, 3, 20, 6, 5, 4
    cache = torch.randn(y, b, cap, dqk, generator=g)
    before = cache.clone()
    lens = torch.tensor([3, 0, 7], dtype=torch.int32)
    scratch = torch.randn(y, b, n, dqk, generator=g)
    feats = torch.randn(b, n, f, generator=g)
    ctx = torch.zeros(b, 4, f)
    idx = torch.tensor([[0, 2, 5, 0], [0, 1, 0, 0], [0, 3, 4, 1]], dtype=torch.int32)
    acc = torch.tensor([3, 1, 4], dtype=torch.int32)
    kv_commit(cache, lens, scratch, idx, acc, feats, ctx)
    assert lens.tolist() == [6, 1, 11]
    for r, (start, m) in enumerate([(3, 3), (0, 1), (7, 4)]):
        sel = idx[r, :m].long()
        assert torch.equal(cache[:, r, start:start + m], scratch[:, r, sel])
        assert torch.equal(cache[:, r, :start], before[:, r, :start])
        assert torch.equal(cache[:, r, start + m:], before[:, r, start + m:])
        assert torch.equal(ctx[r, :m], feats[r, sel])


def test_bitmask_roundtrip_over_word_boundaries():
    for n in (1, 63, 64, 65, 130, 257):
        dense = torch.rand(2, n, n) < 0.5
        assert torch.equal(unpack_mask(pack_mask(dense), n), dense)
