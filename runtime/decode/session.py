"""A decode session: the persistent buffers of b requests at one (mode, budget) and the host loop.

The session owns the target's latent cache (with the forward's workspace), the drafter's context
cache, tree_build's workspace and the RoundBuffers of runtime/decode/round.py, allocated once for a
capacity; CUDA graphs of its step (runtime/decode/graphs.py) bake their addresses in, so a session
is reused across generations and only replaced when a request needs more capacity.  One generation:

  prefill (eager, chunked) -> first token -> the drafter ingests the prompt's features except the
  last <= a rows, which become the first round's context -> rounds until every request stopped.

Host loop (CUDA): launch round k + 1 before reading round k back (the emitted tokens travel in one
[b, a + 5] int64 copy to pinned memory), so the GPU never waits for Python as long as the host's
work per round is shorter than the round.  Finished requests are frozen on the device, so the one
extra round launched after the last token is harmless.

Budget auto (spec.auto, runtime/decode/budget.py): the session holds the buckets' device state
(BucketChoice) and, per way of running (graph replays or eager rounds), a cost curve: the spec's, else
one stored beside the artifact under `autotune_dir`, else measured by the session itself before its
first generation (runtime/decode/autotune.py).  The bucket of each round is recorded in the out row, with
the cap hint: the host builds the next rounds' tree at that bucket, the full tree every EXPLORE-th round.

This is the one decode loop: the Engine (runtime/engine/) keeps sessions per bucket, on one rank
or on every rank of a TP group, and replays their graphs or runs the same step eagerly.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from pathlib import Path
from typing import Iterator

import torch

from core.cache_dir import cache_root
from core.errors import NonFiniteLogits
from plugins.common.device import device_facts
from plugins.common.cubin import CubinUnavailable
from plugins.graph_conditional import setter_cubin
from plugins.tree_build import TreeBuildWorkspace
from runtime.decode.autotune import SessionCurves
from runtime.decode.budget import EXPLORE, BucketChoice, default_buckets
from runtime.decode.clock import StageClock
from runtime.decode.conditional import ConditionalRound, HostChoiceRound
from runtime.decode.graphs import CapturedStep, GraphPool, GraphUnavailable, capture_graph, missing_cuda_kernels
from runtime.decode.memory import check_fits, session_bytes
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.decode.prefill import prefill_requests
from runtime.decode.round import (CapTrees, RoundBuffers, ar_step, draft_tree, one_token_mask, pick, spec_round,
                                  verify_bucket)
from runtime.decode.stats import DecodeStats
from runtime.model.target import TargetModel

INGEST_CHUNK = 256  # prompt rows per drafter call while ingesting the prompt
PREFILL_CHUNK = 256  # prompt tokens per target forward in prefill


class DecodeSession:
    def __init__(self, target: TargetModel, drafter, spec: SpecConfig, batch: int, capacity: int,
                 pool: GraphPool | None = None, prefill_chunk: int = PREFILL_CHUNK, max_stops: int = 16,
                 autotune_dir: str | Path | None = None):
        """spec: the mode (none = AR, chain, ddtree) and budget (fixed, or auto with its curve); capacity:
        committed tokens per request (prompt + new tokens); pool: share graphs' memory (None: never
        capture); autotune_dir: where measured cost curves are stored and found (ART/autotune; None: kept
        in memory)."""
        mode = spec.mode
        prefill_chunk = max(1, min(prefill_chunk, capacity))
        self.target, self.drafter, self.mode, self.batch, self.capacity = target, drafter, mode, batch, capacity
        dev = target.device
        if mode == "none":
            self.drafter = None
            n = a = 1
            self.budget, self.topk = 0, 0
        else:
            if drafter is None:
                raise ValueError(f"spec {mode!r} needs a drafter")
            depth = drafter.block_size - 1
            self.budget, self.topk = spec.tree_shape(depth, target.cfg.vocab_size)
            n, a = self.budget + 1, depth + 1
        self.n, self.a = n, a
        check_fits(session_bytes(target, self.drafter, batch, capacity, n, a, prefill_chunk), dev, self.budget,
                   capacity)  # refuse what cannot fit before allocating anything
        self.cache = target.new_cache(batch, capacity + n + a, max(n, prefill_chunk))
        # headroom for one ingest call (up to INGEST_CHUNK prompt rows, never more than a prompt)
        ingest = min(INGEST_CHUNK, capacity)
        self.dcache = drafter.new_cache(batch, capacity + n + a + ingest) if mode != "none" else None
        feat_dim = len(target.feature_layers) * target.cfg.hidden_size
        self.buf = RoundBuffers.allocate(batch, n, a, feat_dim, target.dtype, dev, max_stops)
        self.tree_ws = (TreeBuildWorkspace.allocate(batch, a - 1, target.cfg.vocab_size, self.budget, self.topk,
                                                    dev).buffer if mode != "none" and dev.type == "cuda" else None)
        self.one = one_token_mask(batch, dev)
        self.choice = BucketChoice(default_buckets(self.budget), dev) if spec.auto and mode == "ddtree" else None
        # the buffers a capped head builds its tree in (budget auto, more than one cap)
        self.capped = CapTrees.allocate(batch, self.choice.buckets[-2] + 1, dev) \
            if self.choice is not None and len(self.choice.caps) > 1 else None
        self.cap = len(self.choice.buckets) - 1 if self.choice is not None else None  # the host's copy of the hint
        if self.choice is not None:
            self.buf.out[:, -1].fill_(self.cap)
        self.curves = SessionCurves(spec.curve, autotune_dir)
        self.pool = pool
        self.graphs: dict[bool, CapturedStep | ConditionalRound | HostChoiceRound] = {}
        self.graph_note = ""
        self.cuda = dev.type == "cuda"
        inflight = 2 if self.cuda else 1
        self.pinned = [torch.zeros(self.buf.out.shape, dtype=torch.int64, pin_memory=True) for _ in range(inflight)] \
            if self.cuda else []

    @property
    def max_stops(self) -> int:
        """Stop ids a request may have (the width of buf.stop_ids)."""
        return self.buf.stop_ids.shape[1]

    # ---- the step, eager or captured
    def step(self, greedy: bool, clock=None, cap: int | None = None) -> None:
        """One round (AR step) of every request, eagerly (with budget auto: on the eager cost curve, the tree
        built at bucket index `cap`, None the largest)."""
        if self.choice is not None:
            self.curves.use(self, None)
        self.raw_step(greedy, clock, cap)

    def raw_step(self, greedy: bool, clock=None, cap: int | None = None) -> None:
        """The step itself: what capture records and what the curve measurement times."""
        if self.mode == "none":
            ar_step(self.target, self.cache, self.buf, self.one, greedy, clock)
        else:
            spec_round(self.target, self.drafter, self.cache, self.dcache, self.buf, self.topk, greedy, self.tree_ws,
                       clock, self.choice, self.capped, cap)

    def capture(self, greedy: bool):
        """Capture the step (once per greedy/sampled): a CapturedStep, or with budget auto a ConditionalRound
        (runtime/decode/conditional.py; HostChoiceRound where that is unavailable).  Warm-up calls run with
        every request frozen (live = 0, nothing committed, the drafter ingests nothing) and all small state
        is restored afterwards, so capturing between generations changes nothing.  With budget auto the
        graph-replay cost curve is found or measured (through the new graph) right after."""
        if greedy in self.graphs:
            return self.graphs[greedy]
        if self.pool is None or not self.cuda:
            raise GraphUnavailable("graphs need a CUDA device")
        missing = missing_cuda_kernels()
        if missing:
            raise GraphUnavailable(f"no CUDA kernel registered for {', '.join(missing)} (the references "
                                   f"synchronise with the host)")
        with self.frozen():
            name = f"{self.mode}-b{self.batch}-B{self.budget}{'-auto' if self.choice else ''}-" \
                   f"{'greedy' if greedy else 'sampled'}"
            if self.choice is None:
                step = CapturedStep(lambda: self.raw_step(greedy), self.pool, name=name)
            else:
                step = self._capture_auto(greedy, name)
                self.curves.use(self, step)
            self.graphs[greedy] = step
        return step

    def _capture_auto(self, greedy: bool, name: str):
        """Budget auto: a head per cap and each bucket's body captured apart, then composed (module doc)."""
        buf, choice = self.buf, self.choice
        heads = {cap: capture_graph(lambda cap=cap: draft_tree(self.drafter, self.cache, self.dcache, buf, self.topk,
                                                               self.tree_ws, None, choice, self.capped, cap),
                                    self.pool, f"{name}-head{choice.buckets[cap]}", keep_graph=True)
                 for cap in choice.caps}
        bodies = [capture_graph(lambda b=b: verify_bucket(self.target, self.cache, buf, greedy, b + 1, None, choice),
                                self.pool, f"{name}-b{b}", keep_graph=True) for b in choice.buckets]
        try:
            # the artifact's cubin when loading registered it
            cubin, _ = setter_cubin(device_facts(self.target.device).arch, cache_root())
            return ConditionalRound(heads, bodies, choice.hot, cubin, name)
        except (CubinUnavailable, GraphUnavailable) as exc:
            return HostChoiceRound(heads, bodies, choice.pick, f"budget auto without conditional nodes ({exc}): the "
                                                               f"host reads each round's bucket (one sync per round)")

    @contextlib.contextmanager
    def frozen(self):
        """Every request frozen while inside (live 0: nothing committed, the drafter ingests nothing); the
        round buffers, cache lengths, the forced bucket and the calibration are restored on the way out."""
        saved = {k: t.clone() for k, t in self.buf.tensors().items()}
        caches = [c for c in (self.cache, self.dcache) if c is not None]
        lens = [c.lens.clone() for c in caches]
        calibration = self.choice.snapshot() if self.choice is not None else None
        try:
            self.buf.live.zero_()
            self.buf.accept_len.zero_()
            yield
        finally:
            for k, t in self.buf.tensors().items():
                t.copy_(saved[k])
            for c, n in zip(caches, lens):
                c.lens.copy_(n)
            if self.choice is not None:
                self.choice.restore(calibration)

    # ---- one generation
    def rounds(self, prompts: list[list[int]], req: SamplingParams, graphs: bool, stats: DecodeStats
               ) -> Iterator[list[list[int]]]:
        """Yield per round the tokens each request emits (the first token of each in the first yield)."""
        b, buf, dev = self.batch, self.buf, self.target.device
        if len(prompts) != b:
            raise ValueError(f"session for {b} requests got {len(prompts)} prompts")
        if len(req.stop_ids) > self.max_stops:
            raise ValueError(f"at most {self.max_stops} stop ids, got {len(req.stop_ids)}")
        greedy = req.temperature <= 0
        stats.prompt_tokens = sum(len(p) for p in prompts)
        stats.extra.update(graphs=False, graph_via=None, graph_note=None)
        t0 = time.perf_counter()
        first = self._start(prompts, req, greedy)
        stats.prefill_s = time.perf_counter() - t0
        live = [int(x) for x in buf.live.tolist()]
        stats.new_tokens += b
        yield [[t] for t in first]
        if not any(live):
            return
        # the decode graph is captured (once per session and greedy/sampled) after the first token is out:
        # capture restores every buffer it touches (frozen), so the prefill's state is what the rounds see
        graph = None
        t0 = time.perf_counter()
        if graphs:
            try:
                graph = self.capture(greedy)
            except GraphUnavailable as exc:
                self.graph_note = f"graphs off: {exc}"
        stats.extra.update(graphs=graph is not None, graph_via=graph.via if graph else None,
                           graph_note=(graph.note if graph else self.graph_note) or None,
                           capture_s=round(time.perf_counter() - t0, 6))
        budgets: Counter[int] = Counter()  # rounds per verified budget (budget auto)
        caps: Counter[int] = Counter()  # rounds per built tree (budget auto)
        if self.choice is not None:
            stats.extra.update(budget_curve=self.curves.use(self, graph), budget_buckets=list(self.choice.buckets))

        clock = None if graph is not None else StageClock(dev)
        launch = graph.launch if graph is not None else (lambda *cap: self.raw_step(greedy, clock, *cap))
        full = len(self.choice.buckets) - 1 if self.choice is not None else None
        a = self.a
        slots = max(len(self.pinned), 1)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(slots)] if self.cuda else []
        inflight: deque[tuple[int, int | None]] = deque()  # (pinned slot, cap) per round in flight
        launched = processed = 0
        gpu_ms = host_s = wait_s = 0.0
        t_dec = time.perf_counter()
        while True:
            t_host = time.perf_counter()
            while any(live) and len(inflight) < slots:
                slot = launched % slots
                if self.cuda:
                    events[slot][0].record()
                if full is None:
                    cap = None
                    launch()
                else:  # budget auto: the tree at the hint's bucket, the full tree every EXPLORE-th round
                    cap = full if launched % EXPLORE == 0 else self.cap
                    launch(cap)
                if self.cuda:
                    self.pinned[slot].copy_(buf.out, non_blocking=True)
                    events[slot][1].record()
                inflight.append((slot, cap))
                launched += 1
            slot, cap = inflight.popleft()
            processed += 1
            if self.cuda:
                t_wait = time.perf_counter()
                events[slot][1].synchronize()
                wait_s += time.perf_counter() - t_wait
                gpu_ms += events[slot][0].elapsed_time(events[slot][1])
                rows = self.pinned[slot].tolist()
            else:
                rows = buf.out.tolist()
            if self.choice is not None:
                budgets[rows[0][a + 4]] += 1
                caps[self.choice.buckets[cap]] += 1
                self.cap = rows[0][a + 5]  # the hint of the last full round read back
            emitted = []
            for r, row in enumerate(rows):
                count, alive, acc_len = row[a], row[a + 1], row[a + 2]
                if row[a + 3] and live[r]:  # the device's non-finite flag of a live request (round.py)
                    raise NonFiniteLogits(f"non-finite logits (NaN or Inf) in decode round {processed} of "
                                          f"request {r}: the weights or activations overflowed; stopped")
                if acc_len > 0:
                    stats.accept_lens.append(acc_len)
                emitted.append(row[:count])
                stats.new_tokens += count
                live[r] = alive
            host_s += time.perf_counter() - t_host
            stats.decode_s = time.perf_counter() - t_dec
            if any(emitted):
                yield emitted
            if not any(live):
                if inflight and self.cuda:  # the rounds launched after the last token: all frozen
                    torch.cuda.current_stream().synchronize()
                break
        stats.decode_s = time.perf_counter() - t_dec
        if clock is not None:
            stats.stage_s = clock.totals_s()
        if self.choice is not None:
            stats.extra.update(budget_histogram=dict(sorted(budgets.items())), budget_caps=dict(sorted(caps.items())),
                               mean_budget=round(sum(b * k for b, k in budgets.items()) / processed, 2),
                               budget_scale=[round(x, 4) for x in self.choice.scale().tolist()])
        stats.extra.update(
            decode_rounds=processed,
            host_us_per_round=round(1e6 * (host_s - wait_s) / processed, 2),
            gpu_us_per_round=round(1e3 * gpu_ms / processed, 2) if self.cuda else None,
            gpu_idle_frac=round(max(0.0, 1 - gpu_ms / 1e3 / stats.decode_s), 4) if self.cuda else None)

    def _start(self, prompts: list[list[int]], req: SamplingParams, greedy: bool) -> list[int]:
        """Reset, prefill, first token, drafter context; returns each request's first token."""
        target, buf = self.target, self.buf
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if longest + req.max_new_tokens > self.capacity:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({req.max_new_tokens}) exceed the session "
                             f"capacity {self.capacity}")
        dev = target.device
        self.cache.lens.zero_()
        # request r samples as a lone request seeded seed + r would (its own (seed, counter) row)
        buf.rng.copy_(torch.tensor([[(req.seed + r + 2**63) % 2**64 - 2**63, 0] for r in range(self.batch)],
                                   dtype=torch.int64))
        buf.inv_temp.fill_(1.0 / req.temperature if req.temperature > 0 else 1.0)
        buf.stop_ids.fill_(-1)
        if req.stop_ids:
            buf.stop_ids[:, :len(req.stop_ids)] = torch.tensor(req.stop_ids, dtype=torch.int64, device=dev)
        buf.max_new.fill_(req.max_new_tokens)
        last_hidden, feats = prefill_requests(target, self.cache, prompts)  # [b, d], [p_r, F] | None each
        first = pick(target, last_hidden, greedy, buf)  # [b]
        buf.bonus.copy_(first)
        first_host = first.tolist()
        bad = [r for r, f in enumerate(buf.nonfinite.tolist()) if f]
        buf.nonfinite.zero_()  # read (pick only ever sets it)
        if bad:
            raise NonFiniteLogits(f"non-finite logits (NaN or Inf) in the prefill of request {bad[0]}: the weights "
                                  f"or activations overflowed; stopped")
        buf.produced.fill_(1)
        buf.live.copy_(torch.tensor([0 if (t in req.stop_ids or req.max_new_tokens <= 1) else 1
                                     for t in first_host], dtype=torch.int32))
        buf.accept_len.zero_()
        if self.dcache is not None:
            self._ingest(prompts, feats)
        return first_host

    def _ingest(self, prompts: list[list[int]], feats: list[torch.Tensor | None]) -> None:
        """The drafter's context cache takes each prompt's features but the last tail_r = min(p_r, a)
        rows, in chunks (their draft logits are discarded: context K/V do not depend on the block);
        the tail becomes the first round's context, as the rows a round commits do."""
        buf, b, a, dev = self.buf, self.batch, self.a, self.target.device
        self.dcache.lens.zero_()
        f_dim = buf.ctx_feats.shape[2]
        tails = [min(len(p), a) for p in prompts]
        heads = [len(p) - t for p, t in zip(prompts, tails)]
        for start in range(0, max(heads), INGEST_CHUNK):
            width = min(INGEST_CHUNK, max(heads) - start)
            ctx = torch.zeros(b, width, f_dim, dtype=buf.ctx_feats.dtype, device=dev)
            toks = torch.zeros(b, width, dtype=torch.int64, device=dev)
            lens = []
            for r, prompt in enumerate(prompts):
                m = max(0, min(width, heads[r] - start))
                lens.append(m)
                if m and feats[r] is not None:
                    ctx[r, :m] = feats[r][start:start + m]
                toks[r, :m] = torch.tensor(prompt[start:start + m], dtype=torch.int64)
            self.drafter.draft(self.dcache, ctx, torch.tensor(lens, dtype=torch.int32, device=dev), buf.bonus, toks)
        buf.ctx_feats.zero_()
        buf.ctx_tokens.zero_()
        for r, prompt in enumerate(prompts):
            t = tails[r]
            if feats[r] is not None:
                buf.ctx_feats[r, :t] = feats[r][heads[r]:]
            buf.ctx_tokens[r, :t] = torch.tensor(prompt[heads[r]:], dtype=torch.int64)
        buf.accept_len.copy_(torch.tensor(tails, dtype=torch.int32))

