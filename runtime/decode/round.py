"""The static decode step: one speculative round (or one AR step) over persistent buffers.

Everything a step reads or writes lives in preallocated tensors sized for (b requests, N tree
nodes, a = D + 1 accept slots), so the same function runs eagerly (CPU reference, CUDA eager) or
is captured once into a CUDA graph and replayed (runtime/decode/graphs.py): no host sync, no Python
state that changes between calls, every result copied into a buffer.

  spec_round:  draft -> tree_build -> verify (target over the N tree tokens) -> posterior
               (`pick`: the kdtree::posterior op: argmax, or a counter-based sample) -> tree_accept
               -> emit (kdtree::round_emit, which also takes the accepted path's tokens) -> kv_commit
  ar_step:     target over the bonus token -> kv_commit (rows only) -> next token -> emit (which also advances
               the committed lengths: one launch fewer)

Budget per round (`--budget auto`, runtime/decode/budget.py): tree_build also writes each node's path
log-probability, the round chooses a bucket b on the device and verifies, accepts, commits and emits the
tree's first b + 1 nodes only (the tree of budget b: tree_build's nodes are prefix-closed).  The round
is a head (draft_tree: draft, tree_build at the round's cap, the choice) and one body per bucket
(verify_bucket).  A head capped below the largest bucket builds the smaller tree into CapTrees and
copies it over the first nodes of the round buffers, so every body reads the same buffers.  Captured,
each is its own graph and runtime/decode/conditional.py composes them, the bodies as the branches of one
CUDA-graph SWITCH node whose value a kernel of the graph sets from the device's one-hot choice, so the graph picks
its bucket without a host sync; eager (the CPU reference, CUDA without graphs), the host reads the
choice (one .item(), a sync) and runs that bucket's body: the same bucket either way.  Every body
writes the same buffers, so the rest of the session does not depend on the bucket.

Emission (both): this step's candidate tokens (the accepted path's tokens after the root, then
the new bonus; for AR the one new token) are cut at the first stop token or at max_new, and
written to out [b, a + 6] = tokens | count | live | accept_len | nonfinite (the logits held a NaN
or Inf) | budget (with budget auto: the tree nodes verified besides the root) | cap hint (with budget auto:
the bucket index to build the next rounds' tree at, written by full rounds), the one buffer the host
reads back per round.  A request that has finished (live 0) is frozen: it commits and emits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from plugins.common.bitmask import causal_mask, mask_words
from plugins.kv_commit import kv_commit
from plugins.round_emit import round_emit
from plugins.tree_accept import tree_accept
from plugins.tree_accept.posterior import posterior
from plugins.tree_build import tree_build
from runtime.decode.budget import BucketChoice
from runtime.decode.clock import no_clock
from runtime.model.cache import LatentCache
from runtime.model.target import TargetModel


@dataclass
class RoundBuffers:
    """Per-session device state of b requests.  Small tensors only; the caches live beside it."""

    bonus: torch.Tensor  # [b] int64 last emitted token, not yet in the cache (the next tree's root)
    accept_len: torch.Tensor  # [b] int32 path length of the last round = rows the drafter ingests next
    accept_idx: torch.Tensor  # [b, a] int32
    ctx_feats: torch.Tensor  # [b, a, F] target features of the rows committed last round (F >= 1)
    ctx_tokens: torch.Tensor  # [b, a] int64 tokens of those rows (for drafters that work from tokens)
    tokens: torch.Tensor  # [b, N] int64 tree
    parents: torch.Tensor  # [b, N] int32
    depth: torch.Tensor  # [b, N] int32
    positions: torch.Tensor  # [b, N] int64
    mask: torch.Tensor  # [b, N, w] int64
    scores: torch.Tensor  # [b, N] fp32 path log-prob of each node under the drafter (budget auto only)
    out: torch.Tensor  # [b, a + 6] int64 emitted tokens | count | live | accept_len | nonfinite | budget | cap hint
    live: torch.Tensor  # [b] int32 1 while the request is generating
    produced: torch.Tensor  # [b] int32 tokens emitted so far
    max_new: torch.Tensor  # [b] int32
    stop_ids: torch.Tensor  # [b, S] int64, padded with -1
    rng: torch.Tensor  # [b, 2] int64 (seed, counter) per request
    inv_temp: torch.Tensor  # [b] fp32 1 / temperature per request (unused when greedy)
    nonfinite: torch.Tensor  # [b] int64 1: request's logits held a NaN or Inf (set by `pick`, cleared by its reader)

    @classmethod
    def allocate(cls, b: int, n: int, a: int, feat_dim: int, dtype: torch.dtype, device, max_stops: int = 8
                 ) -> "RoundBuffers":
        """n tree nodes (1 for AR), a accept slots (1 for AR), feat_dim the target's feature width
        (0 when it returns none: a width-1 placeholder is kept)."""
        def z(*shape, dt=torch.int64):
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(bonus=z(b), accept_len=z(b, dt=torch.int32), accept_idx=z(b, a, dt=torch.int32),
                   ctx_feats=z(b, a, max(feat_dim, 1), dt=dtype), ctx_tokens=z(b, a),
                   tokens=z(b, n), parents=z(b, n, dt=torch.int32), depth=z(b, n, dt=torch.int32),
                   positions=z(b, n), mask=z(b, n, mask_words(n)), scores=z(b, n, dt=torch.float32),
                   out=z(b, a + 6), live=z(b, dt=torch.int32),
                   produced=z(b, dt=torch.int32), max_new=z(b, dt=torch.int32),
                   stop_ids=torch.full((b, max_stops), -1, dtype=torch.int64, device=device),
                   rng=z(b, 2), inv_temp=torch.ones(b, dtype=torch.float32, device=device), nonfinite=z(b))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def pick(target: TargetModel, hidden: torch.Tensor, greedy: bool, buf: RoundBuffers, rows: slice = slice(None)
         ) -> torch.Tensor:
    """hidden [b', ..., d] of the requests buf[rows] (b' of them; all b by default) -> token ids [b', ...]
    int64: under TP at T = 0 target.greedy (a distributed argmax, no vocabulary gather); else the
    kdtree::posterior op over the full logits: the argmax at T = 0, a counter-based sample of
    softmax(logits / T) at T > 0, request r drawn from its own buf.rng[r] and buf.inv_temp[r] (the same
    draws on every rank: the logits are gathered to every rank).  Either sets buf.nonfinite[r] = 1 when request
    r's logits held a NaN or Inf (in the same pass); its reader clears it (round_emit copies it into the out row
    the host reads with the round's tokens, no sync; the prefill's reader is the host)."""
    if greedy and target.comm is not None:
        return target.greedy(hidden, buf.nonfinite[rows])[0]  # the flag: a row's best logit was NaN / Inf
    logits = target.logits(hidden)  # [b', ..., v]
    out = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    posterior(logits, greedy, buf.rng[rows], buf.inv_temp[rows], out, buf.nonfinite[rows])
    return out


def spec_round(target: TargetModel, drafter, cache: LatentCache, dcache, buf: RoundBuffers, topk: int, greedy: bool,
               tree_ws: torch.Tensor | None, clock=None, choice: BucketChoice | None = None,
               capped: "CapTrees | None" = None, cap: int | None = None) -> None:
    """One speculative round for all b requests, eagerly; see the module docstring.  tree_ws: tree_build's
    workspace buffer (TreeBuildWorkspace; None on CPU, where the op is the reference).  `clock(stage)` (a
    context manager factory, runtime/decode/clock.StageClock) times the stages of an eager call; None
    when captured.  choice: budget auto (the buckets and their device state), None for the whole tree;
    with it the host reads the device's choice (one .item(), a sync: the reference behaviour; a captured
    round decides on the device instead, runtime/decode/conditional.py).  cap: with choice, the bucket
    index to build the tree at (None: the largest), capped: the buffers a capped tree is built in."""
    clock = clock or no_clock
    draft_tree(drafter, cache, dcache, buf, topk, tree_ws, clock, choice, capped, cap)
    if choice is None:
        verify_bucket(target, cache, buf, greedy, buf.tokens.shape[1], clock)
        return
    i = int(choice.pick.item())
    if i < len(choice.buckets):
        verify_bucket(target, cache, buf, greedy, choice.buckets[i] + 1, clock, choice)


@dataclass
class CapTrees:
    """Flat buffers a capped head builds its tree in (tree_build writes contiguous [b, n] outputs; a prefix
    of the round buffers is not contiguous for b > 1, the mask's never), sized for the largest capped tree."""

    tokens: torch.Tensor  # [b * n] int64
    parents: torch.Tensor  # [b * n] int32
    depth: torch.Tensor  # [b * n] int32
    positions: torch.Tensor  # [b * n] int64
    mask: torch.Tensor  # [b * n * mask_words(n)] int64
    scores: torch.Tensor  # [b * n] fp32

    @classmethod
    def allocate(cls, b: int, n: int, device) -> "CapTrees":
        """For trees of up to n nodes (root included)."""
        def z(size, dt):
            return torch.zeros(size, dtype=dt, device=device)

        return cls(z(b * n, torch.int64), z(b * n, torch.int32), z(b * n, torch.int32), z(b * n, torch.int64),
                   z(b * n * mask_words(n), torch.int64), z(b * n, torch.float32))

    def views(self, b: int, n: int) -> tuple[torch.Tensor, ...]:
        """tokens, parents, depth, positions [b, n], mask [b, n, mask_words(n)], scores [b, n]: contiguous."""
        flat = [t[:b * n].view(b, n) for t in (self.tokens, self.parents, self.depth, self.positions)]
        w = mask_words(n)
        return (*flat, self.mask[:b * n * w].view(b, n, w), self.scores[:b * n].view(b, n))


def draft_tree(drafter, cache: LatentCache, dcache, buf: RoundBuffers, topk: int, tree_ws: torch.Tensor | None,
               clock=None, choice: BucketChoice | None = None, capped: CapTrees | None = None,
               cap: int | None = None) -> None:
    """The round's head: draft, build the tree at the session's budget (with budget auto: at bucket `cap`,
    None the largest) into buf and, with budget auto, choose the bucket to verify on the device
    (choice.pick, choice.hot; a full round also writes the cap hint into out's last column)."""
    clock = clock or no_clock
    with clock("draft"):
        logits = drafter.draft(dcache, buf.ctx_feats, buf.accept_len, buf.bonus, buf.ctx_tokens)  # [b, D, V]
    with clock("build"):
        full = choice is None or cap is None or cap == len(choice.buckets) - 1
        if full:
            tree_build(logits, buf.bonus, cache.lens, topk, buf.tokens, buf.parents, buf.depth, buf.positions,
                       buf.mask, tree_ws, buf.scores if choice is not None else None)
        else:
            b, n = buf.tokens.shape[0], choice.buckets[cap] + 1
            tokens, parents, depth, positions, mask, scores = capped.views(b, n)
            # the bodies read tokens, parents, positions and the first mask words of the first n nodes
            rows = (buf.tokens, buf.parents, buf.positions, buf.scores)
            if b == 1:  # one request: those prefixes are contiguous, the tree is built straight into them
                tokens, parents, positions, scores = (t[:, :n] for t in rows)
            tree_build(logits, buf.bonus, cache.lens, topk, tokens, parents, depth, positions, mask, tree_ws,
                       scores)
            if b > 1:
                for dst, src in zip(rows, (tokens, parents, positions, scores)):
                    dst[:, :n].copy_(src)
            buf.mask[:, :n, :mask.shape[2]].copy_(mask)  # [b, n, w_n] into [b, N, w]: never contiguous
        if choice is not None:
            choice.select(buf.scores, buf.live, cap)  # choice.pick [], choice.hot [nb] on the device
            if full:
                buf.out[:, -1].copy_(choice.hint)


def verify_bucket(target: TargetModel, cache: LatentCache, buf: RoundBuffers, greedy: bool, n: int, clock=None,
                  choice: BucketChoice | None = None) -> None:
    """The round's body: verify, accept, commit and emit the tree's first n nodes (n = N: all of it), into
    buf; with budget auto, the out row records the bucket and the accepted path calibrates the next
    rounds' estimates."""
    clock = clock or no_clock
    tokens, parents, positions, mask = _tree_prefix(buf, n)
    with clock("verify"):
        hidden, feats = target.forward(tokens, positions, cache, mask)  # [b, n, d], [b, n, F] | None
        chosen = pick(target, hidden, greedy, buf)  # [b, n] the target's token after each node
    with clock("accept"):
        tree_accept(chosen, tokens, parents, buf.accept_idx, buf.accept_len, buf.bonus)
    with clock("commit"):
        # one kernel: accept_len *= live (finished requests stay frozen), the accepted path's tokens (root first;
        # slots >= accept_len stale, < N) into ctx_tokens, and the emission of the path past the root + bonus
        round_emit(None, buf.accept_len, buf.stop_ids, buf.produced, buf.max_new, buf.live, buf.nonfinite, buf.out,
                   buf.bonus, buf.tokens, buf.accept_idx, buf.ctx_tokens)
        kv_commit(cache.kv, cache.lens, cache.scratch, buf.accept_idx, buf.accept_len, feats,
                  buf.ctx_feats if feats is not None else None)
        a = buf.accept_idx.shape[1]
    if choice is not None:
        with clock("accept"):
            buf.out[:, a + 4].fill_(n - 1)  # the budget column (fixed sessions leave it unread)
            choice.observe(buf.accept_len, buf.accept_idx, n - 1)


def _tree_prefix(buf: RoundBuffers, n: int) -> tuple[torch.Tensor, ...]:
    """tokens, parents, positions [b, n] and mask [b, n, mask_words(n)] of the tree's first n nodes: the
    buffers themselves for the whole tree, else contiguous copies (a no-op for b = 1)."""
    if n == buf.tokens.shape[1]:
        return buf.tokens, buf.parents, buf.positions, buf.mask
    return (buf.tokens[:, :n].contiguous(), buf.parents[:, :n].contiguous(), buf.positions[:, :n].contiguous(),
            buf.mask[:, :n, :mask_words(n)].contiguous())


def ar_step(target: TargetModel, cache: LatentCache, buf: RoundBuffers, one: torch.Tensor, greedy: bool,
            clock=None) -> None:
    """One AR step: the bonus token through the target, committed, then the next token emitted.
    one [b, 1, 1] int64 is the one-token chain mask (a persistent buffer: causal_mask(b, 1))."""
    clock = clock or no_clock
    with clock("verify"):
        hidden, _ = target.forward(buf.bonus[:, None], cache.lens[:, None], cache, one, features=False)  # [b, 1, d]
        nxt = pick(target, hidden[:, 0], greedy, buf)  # [b]
    with clock("commit"):
        kv_commit(cache.kv, cache.lens, cache.scratch, buf.accept_idx, buf.live, advance=False)
        # accept_len := live, bonus := nxt where live, lens += live (the commit's advance), then the emission: one
        # kernel on CUDA
        round_emit(nxt[:, None], buf.accept_len, buf.stop_ids, buf.produced, buf.max_new, buf.live, buf.nonfinite,
                   buf.out, buf.bonus, cache_lens=cache.lens)


def one_token_mask(b: int, device) -> torch.Tensor:
    """[b, 1, 1] int64 chain mask of an AR step."""
    return causal_mask(b, 1, device)
