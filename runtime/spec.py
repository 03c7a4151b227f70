"""Speculative decoding rounds: draft -> tree_build -> verify -> tree_accept -> kv_commit.

Modes: `ddtree` (the B best prefixes of the draft, K = B candidates per depth), `chain` (DFlash's
single path: one candidate per depth, B = D).  A round for b requests, each with its own cache
length and tree:

  draft       drafter(context features of last round's committed tokens, bonus) -> logits [b, D, V]
  tree_build  -> tokens, parents, depth, positions [b, N], mask [b, N, w]      (N = B + 1, root = bonus)
  verify      target.forward over the N tree tokens -> hidden, features [b, N, .]; posterior [b, N]
  tree_accept -> accept_idx [b, D+1], accept_len [b], next bonus [b]
  kv_commit   accepted rows -> latent cache; their features -> next round's drafter context

Emitted per round and request: the accepted node tokens, then the bonus (accept_len tokens).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import torch

from plugins.bitmask import mask_words
from plugins.kv_commit import kv_commit
from plugins.tree_accept import tree_accept
from plugins.tree_build import tree_build
from runtime.generate import SamplingParams, Stats, prefill_requests
from runtime.model import TargetModel
from runtime.sampling import sample

STAGES = ("draft", "build", "verify", "accept", "commit")


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "ddtree"  # "ddtree" | "chain"
    budget: int = 16  # tree nodes besides the root (ddtree)

    def __post_init__(self) -> None:
        if self.mode not in ("ddtree", "chain"):
            raise ValueError(f"--spec must be none, chain or ddtree, got {self.mode!r}")
        if self.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {self.budget}")

    def tree_shape(self, depth: int, vocab: int) -> tuple[int, int]:
        """(budget B, candidates per depth K) for drafts of `depth` positions."""
        if self.mode == "chain":
            return depth, 1
        k = min(self.budget, vocab)
        if depth == 1 and self.budget > vocab:
            raise ValueError(f"--budget {self.budget} exceeds the {vocab} prefixes of a depth-1 draft")
        return self.budget, k


class SpecStats(Stats):
    """Stats plus rounds, tau and per-stage time."""

    def __init__(self):
        super().__init__()
        self.accept_lens: list[int] = []
        self.stage_s = {k: 0.0 for k in STAGES}

    def as_dict(self) -> dict:
        d = super().as_dict()
        rounds = len(self.accept_lens)
        d.update(rounds=rounds, tau=round(sum(self.accept_lens) / rounds, 4) if rounds else None,
                 accept_len_histogram=dict(sorted(Counter(self.accept_lens).items())),
                 stage_ms={k: round(1e3 * v, 3) for k, v in self.stage_s.items()})
        return d


class _Timer:
    def __init__(self, stats: SpecStats, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"

    def __call__(self, stage: str):
        return _Stage(self, stage)


class _Stage:
    def __init__(self, timer: _Timer, stage: str):
        self.timer, self.stage = timer, stage

    def __enter__(self):
        if self.timer.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.timer.cuda:
            torch.cuda.synchronize()
        self.timer.stats.stage_s[self.stage] += time.perf_counter() - self.t0


def spec_rounds(target: TargetModel, drafter, prompts: list[list[int]], params: SamplingParams, spec: SpecConfig,
                stats: SpecStats) -> Iterator[list[list[int]]]:
    """Yield, per round, the tokens each request emits (prefill's first token in the first yield).

    Requests that have finished (stop token or max_new_tokens) keep their state frozen
    (accept_len 0) and emit nothing.
    """
    dev = target.device
    b = len(prompts)
    depth = drafter.block_size - 1
    budget, topk = spec.tree_shape(depth, target.cfg.vocab_size)
    n, a = budget + 1, depth + 1
    longest = max(len(p) for p in prompts)
    capacity = longest + params.max_new_tokens + n + a + 1
    cache = target.new_cache(b, capacity, max(n, min(longest, 256)))
    dcache = drafter.new_cache(b, capacity + max(longest, a))
    gen = torch.Generator(device=dev).manual_seed(params.seed)
    stats.prompt_tokens = sum(len(p) for p in prompts)
    timer = _Timer(stats, dev)

    t0 = time.perf_counter()
    feat_dim = max(len(target.feature_layers) * target.cfg.hidden_size, 1)
    ctx_feats = torch.zeros(b, longest, feat_dim, dtype=target.dtype, device=dev)
    ctx_len = torch.zeros(b, dtype=torch.int32, device=dev)
    ctx_tokens = torch.zeros(b, longest, dtype=torch.long, device=dev)
    last_hidden, prompt_feats = prefill_requests(target, cache, prompts)
    for r, prompt in enumerate(prompts):
        if prompt_feats[r] is not None:
            ctx_feats[r, : len(prompt)] = prompt_feats[r]
        ctx_len[r] = len(prompt)
        ctx_tokens[r, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    bonus = sample(target.logits(last_hidden), params.temperature, gen)  # [b]
    stats.prefill_s = time.perf_counter() - t0
    done = [False] * b
    produced = [0] * b
    first = [[int(t)] for t in bonus.tolist()]
    for r in range(b):
        produced[r], done[r] = 1, _finished(first[r][-1], 1, params)
    stats.new_tokens += b
    yield first

    tokens = torch.zeros(b, n, dtype=torch.long, device=dev)
    parents = torch.zeros(b, n, dtype=torch.int32, device=dev)
    depth_t = torch.zeros(b, n, dtype=torch.int32, device=dev)
    positions = torch.zeros(b, n, dtype=torch.long, device=dev)
    mask = torch.zeros(b, n, mask_words(n), dtype=torch.int64, device=dev)
    accept_idx = torch.zeros(b, a, dtype=torch.int32, device=dev)
    accept_len = torch.zeros(b, dtype=torch.int32, device=dev)
    next_bonus = torch.zeros(b, dtype=torch.long, device=dev)
    next_ctx = torch.zeros(b, a, feat_dim, dtype=target.dtype, device=dev)
    t_decode = time.perf_counter()
    while not all(done):
        with timer("draft"):
            logits = drafter.draft(dcache, ctx_feats, ctx_len, bonus, ctx_tokens)  # [b, D, V]
        with timer("build"):
            tree_build(logits, bonus, cache.lens.long(), topk, tokens, parents, depth_t, positions, mask)
        with timer("verify"):
            hidden, feats = target.forward(tokens, positions, cache, mask)  # [b, N, d], [b, N, F]
            posterior = sample(target.logits(hidden), params.temperature, gen)  # [b, N]
        with timer("accept"):
            tree_accept(posterior, tokens, parents, accept_idx, accept_len, next_bonus)
            live = torch.tensor([not x for x in done], device=dev)
            accept_len.mul_(live.to(torch.int32))  # finished requests stay frozen
        with timer("commit"):
            kv_commit(cache.kv, cache.lens, cache.scratch, accept_idx, accept_len, feats,
                      next_ctx if feats is not None else None)
        path_tokens = tokens.gather(1, accept_idx.long())  # [b, a]
        emitted: list[list[int]] = []
        lens, path, nb = accept_len.tolist(), path_tokens.tolist(), next_bonus.tolist()
        for r in range(b):
            out: list[int] = []
            if not done[r]:
                stats.accept_lens.append(lens[r])
                for t in path[r][1: lens[r]] + [nb[r]]:
                    out.append(t)
                    produced[r] += 1
                    if _finished(t, produced[r], params):
                        done[r] = True
                        break
            stats.new_tokens += len(out)
            emitted.append(out)
        stats.decode_s = time.perf_counter() - t_decode
        yield emitted
        # the draft stage reads these before this round's accept/commit rewrite them, so from the
        # second round on the buffers are simply shared
        ctx_feats, ctx_len, bonus, ctx_tokens = next_ctx, accept_len, next_bonus, path_tokens


def _finished(token: int, produced: int, params: SamplingParams) -> bool:
    return token in params.stop_ids or produced >= params.max_new_tokens


def generate_spec(target: TargetModel, drafter, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig,
                  stats: SpecStats | None = None) -> Iterator[int]:
    """Stream the new tokens of one request decoded speculatively."""
    stats = stats if stats is not None else SpecStats()
    if params.max_new_tokens == 0:
        return
    for per_request in spec_rounds(target, drafter, [prompt_ids], params, spec, stats):
        yield from per_request[0]


def generate_spec_batch(target: TargetModel, drafter, prompts: list[list[int]], params: SamplingParams,
                        spec: SpecConfig, stats: SpecStats | None = None) -> list[list[int]]:
    """Decode a batch of requests together; returns the new tokens of each."""
    stats = stats if stats is not None else SpecStats()
    outs: list[list[int]] = [[] for _ in prompts]
    if params.max_new_tokens == 0:
        return outs
    for per_request in spec_rounds(target, drafter, prompts, params, spec, stats):
        for r, toks in enumerate(per_request):
            outs[r] += toks
    return outs
