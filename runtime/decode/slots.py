"""SlotBatch: a DecodeSession's b rows as slots that requests take and give back between rounds.

DecodeSession.rounds runs one cohort from prefill to its last token.  A server needs continuous
batching instead: a request joins a free row while the others are mid-generation, and leaves (it
finished, or its client went away) without ending the rest.  Every per-request quantity of the
static round already lives in a row of the session's buffers (bonus, live, produced, max_new,
stop_ids, cache lens, drafter context), and a frozen row (live 0) commits and emits nothing, so a
slot is only this:

  admit(prompt, params)   take free row r for the request; its prompt is not in the cache yet
  prefill(r)              the next chunk of row r's prompt into its cache view (prefill_chunk, the
                          chunks `kdtree run`'s prefill takes), the drafter ingesting the prompt rows
                          that chunk completed; after the last chunk: its first token, its buffer
                          row, and the row is live
  step()                  one round of every row (the session's step, eager or a captured graph)
  release(r)              live[r] = 0: the row is frozen from the next round on, and free

A joining row stays frozen while its prompt goes in, so the caller can run the other rows' rounds
between its chunks: a long prompt never stalls the batch for more than one chunk.  What a frozen row's
round writes past its committed cache length (tree scratch, drafter block rows) is overwritten by its
next chunk before it becomes visible.

Rows are independent: at T = 0 trivially, at T > 0 because each row draws from its own counter-based
generator state (buf.rng[r] = (seed, counter), buf.inv_temp[r] = 1 / T, set by the last prefill
chunk), so a seeded request samples the same tokens in any batch as `kdtree run --seed` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import NonFiniteLogits
from runtime.decode.graphs import CapturedStep, GraphUnavailable
from runtime.decode.params import SamplingParams
from runtime.decode.prefill import prefill_chunk
from runtime.decode.round import pick
from runtime.decode.session import INGEST_CHUNK, DecodeSession


@dataclass
class RowEmission:
    row: int
    tokens: list[int]  # emitted this round (a stop token, when hit, last)
    live: bool  # still generating after this round
    accept_len: int  # accepted path length this round (tokens per round, bonus included); 0 when frozen
    nonfinite: bool = False  # its logits held a NaN or Inf: nothing was emitted, the row is released


@dataclass
class Prefilled:
    """What one prefill(r) call did."""

    tokens: int  # prompt tokens it put in the cache
    first: int | None = None  # the request's first token once its whole prompt is in; None: more chunks to go
    live: bool = False  # the row generates on (False: the first token ended it, or it was the only one asked)


@dataclass
class _Joining:
    """A row whose prompt is going into the caches."""

    prompt: list[int]
    params: SamplingParams
    done: int = 0  # prompt tokens in the target's cache
    ingested: int = 0  # prompt rows in the drafter's cache
    feats: torch.Tensor | None = None  # [done - ingested, F] target features the drafter has not taken yet


class SlotBatch:
    def __init__(self, session: DecodeSession, greedy: bool, graphs: bool = True):
        """session: its batch is the number of slots; greedy: T = 0 for every request of it (the step
        is captured per greedy/sampled).  graphs: replay a captured step where the session can (CUDA)."""
        self.session, self.greedy = session, greedy
        self.free = list(range(session.batch))
        self.active: set[int] = set()
        self.joining: dict[int, _Joining] = {}
        self.chunk = session.cache.tokens_per_forward  # prompt tokens per prefill call, as prefill() takes them
        self.graph: CapturedStep | None = None
        self.graph_note = ""
        if graphs and session.cuda:
            try:
                self.graph = session.capture(greedy)
            except GraphUnavailable as exc:
                self.graph_note = f"graphs off: {exc}"

    @property
    def capacity(self) -> int:
        """Tokens a request may hold: prompt + max_new_tokens."""
        return self.session.capacity

    def admit(self, prompt: list[int], params: SamplingParams) -> int:
        """Take a free row for `prompt` -> the row, frozen until prefill(row) has put the whole prompt in;
        ValueError when the request does not fit this slot batch."""
        s = self.session
        if not self.free:
            raise ValueError(f"all {s.batch} slots are taken")
        if (params.temperature <= 0) != self.greedy:
            raise ValueError(f"a {'greedy' if self.greedy else 'sampled'} slot batch got temperature "
                             f"{params.temperature}")
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt) + params.max_new_tokens > s.capacity:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceed the "
                             f"slot capacity {s.capacity}")
        if len(params.stop_ids) > s.max_stops:
            raise ValueError(f"at most {s.max_stops} stop ids, got {len(params.stop_ids)}")
        r = self.free.pop(0)
        s.buf.live[r] = 0
        s.buf.accept_len[r] = 0  # the drafter takes nothing of this row in the rounds before it is live
        s.cache.lens[r] = 0
        if s.dcache is not None:
            s.dcache.lens[r] = 0
        self.joining[r] = _Joining(list(prompt), params)
        return r

    def prefill(self, r: int) -> Prefilled:
        """The next chunk of joining row r's prompt; after the last one the row is live (or, when its
        first token ended it, free again).  NonFiniteLogits (the row freed) when the prefill overflowed."""
        s, buf, j = self.session, self.session.buf, self.joining[r]
        dev = s.target.device
        p = len(j.prompt)
        n = min(self.chunk, p - j.done)
        ids = torch.tensor(j.prompt[j.done:j.done + n], dtype=torch.long, device=dev)  # [n]
        hidden, feats = prefill_chunk(s.target, s.cache.request(r), ids)  # [n, d], [n, F] | None
        j.done += n
        if s.dcache is not None:
            if feats is not None:
                j.feats = feats if j.feats is None else torch.cat([j.feats, feats])
            self._ingest(r, j)
        if j.done < p:
            return Prefilled(n)
        del self.joining[r]
        params = j.params
        if not self.greedy:
            buf.rng[r] = torch.tensor([params.seed, 0], dtype=torch.int64)
            buf.inv_temp[r] = 1.0 / params.temperature
        first = int(pick(s.target, hidden[-1][None], self.greedy, buf, slice(r, r + 1))[0])
        bad = bool(buf.nonfinite[r])
        buf.nonfinite[r] = 0  # read (pick only ever sets it)
        if bad:
            self.free.append(r)
            raise NonFiniteLogits(f"non-finite logits (NaN or Inf) in the prefill of a {p}-token prompt: "
                                  f"the weights or activations overflowed")
        live = first not in params.stop_ids and params.max_new_tokens > 1
        buf.bonus[r] = first
        buf.produced[r] = 1
        buf.max_new[r] = params.max_new_tokens
        buf.stop_ids[r].fill_(-1)
        if params.stop_ids:
            buf.stop_ids[r, :len(params.stop_ids)] = torch.tensor(params.stop_ids, dtype=torch.int64, device=dev)
        if s.dcache is not None:
            self._context(r, j)
        buf.live[r] = int(live)
        (self.active.add if live else self.free.append)(r)
        return Prefilled(n, first, live)

    def _ingest(self, r: int, j: _Joining) -> None:
        """Row r's prompt into the drafter's context cache as DecodeSession._ingest takes it: all but the
        last tail = min(p, a) rows, in INGEST_CHUNK pieces from the start (each piece once the target's
        chunks have covered it).  The other rows ingest nothing (length 0); the rows the drafter writes
        past their committed length are overwritten before they become visible."""
        s, buf = self.session, self.session.buf
        b, dev = s.batch, s.target.device
        head = len(j.prompt) - min(len(j.prompt), s.a)
        while j.ingested < head and min(j.ingested + INGEST_CHUNK, head) <= j.done:
            width = min(INGEST_CHUNK, head - j.ingested)
            ctx = torch.zeros(b, width, buf.ctx_feats.shape[2], dtype=buf.ctx_feats.dtype, device=dev)  # [b, w, F]
            toks = torch.zeros(b, width, dtype=torch.int64, device=dev)  # [b, w]
            if j.feats is not None:
                ctx[r] = j.feats[:width]
                j.feats = j.feats[width:]
            toks[r] = torch.tensor(j.prompt[j.ingested:j.ingested + width], dtype=torch.int64)
            lens = torch.zeros(b, dtype=torch.int32, device=dev)
            lens[r] = width
            s.drafter.draft(s.dcache, ctx, lens, buf.bonus, toks)
            j.ingested += width

    def _context(self, r: int, j: _Joining) -> None:
        """The prompt's tail (the rows the drafter has not taken) as row r's first round context."""
        buf = self.session.buf
        tail = len(j.prompt) - j.ingested
        buf.ctx_feats[r].zero_()
        buf.ctx_tokens[r].zero_()
        if j.feats is not None:
            buf.ctx_feats[r, :tail] = j.feats
        buf.ctx_tokens[r, :tail] = torch.tensor(j.prompt[j.ingested:], dtype=torch.int64)
        buf.accept_len[r] = tail

    def step(self) -> list[RowEmission]:
        """One round of every row; what each active row emitted.  Rows that finished are released."""
        s = self.session
        if self.graph is not None:
            self.graph.launch()
        else:
            s.step(self.greedy)
        rows = s.buf.out.tolist()  # [b, a + 5]: tokens | count | live | accept_len | nonfinite | budget
        a, out = s.a, []
        for r in sorted(self.active):
            row = rows[r]
            count, live, acc, bad = row[a], bool(row[a + 1]), row[a + 2], bool(row[a + 3])
            out.append(RowEmission(r, [] if bad else row[:count], live and not bad, acc, bad))
            if bad or not live:
                self.release(r)
        return out

    def release(self, r: int) -> None:
        """Free row r (finished, or its request was cancelled, joining or live): frozen from the next round on."""
        if r in self.active or r in self.joining:
            self.active.discard(r)
            self.joining.pop(r, None)
            self.session.buf.live[r] = 0
            self.free.append(r)
