"""SlotBatch: a DecodeSession's b rows as slots that requests take and give back between rounds.

DecodeSession.rounds runs one cohort from prefill to its last token.  A server needs continuous
batching instead: a request joins a free row while the others are mid-generation, and leaves (it
finished, or its client went away) without ending the rest.  Every per-request quantity of the
static round already lives in a row of the session's buffers (bonus, live, produced, max_new,
stop_ids, cache lens, drafter context), and a frozen row (live 0) commits and emits nothing, so a
slot is only this:

  admit(prompt, params)   prefill row r alone (its cache view), pick its first token, set its
                          buffer row, ingest its prompt into row r of the drafter's cache
  step()                  one round of every row (the session's step, eager or a captured graph)
  release(r)              live[r] = 0: the row is frozen from the next round on, and free

Rows are independent at T = 0, so a request's tokens do not depend on its neighbours.  At T > 0 the
session's counter-based generator (buf.rng, one (seed, counter) per session) is shared by the
rows, so a seeded request is reproducible only alone: the caller keeps sampled requests in
batch-1 slot batches, where admit sets (seed, 0) and 1 / T as DecodeSession.rounds does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import NonFiniteLogits
from runtime.decode.graphs import CapturedStep, GraphUnavailable
from runtime.decode.params import SamplingParams
from runtime.decode.prefill import prefill
from runtime.decode.round import pick
from runtime.decode.session import INGEST_CHUNK, DecodeSession


@dataclass
class RowEmission:
    row: int
    tokens: list[int]  # emitted this round (a stop token, when hit, last)
    live: bool  # still generating after this round
    accept_len: int  # accepted path length this round (tokens per round, bonus included); 0 when frozen
    nonfinite: bool = False  # its logits held a NaN or Inf: nothing was emitted, the row is released


class SlotBatch:
    def __init__(self, session: DecodeSession, greedy: bool, graphs: bool = True):
        """session: its batch is the number of slots; greedy: T = 0 for every request of it (the step
        is captured per greedy/sampled).  graphs: replay a captured step where the session can (CUDA)."""
        self.session, self.greedy = session, greedy
        self.free = list(range(session.batch))
        self.active: set[int] = set()
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

    def admit(self, prompt: list[int], params: SamplingParams) -> tuple[int, int, bool]:
        """Take a free row for `prompt` -> (row, first token, live after it)."""
        s, buf = self.session, self.session.buf
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
        dev = s.target.device
        if not self.greedy:
            buf.rng.copy_(torch.tensor([params.seed, 0], dtype=torch.int64))
            buf.inv_temp.fill_(1.0 / params.temperature)
        view = s.cache.request(r)
        view.lens.zero_()
        last_hidden, feats = prefill(s.target, view, torch.tensor(prompt, dtype=torch.long, device=dev))
        first = int(pick(s.target, last_hidden[None], self.greedy, buf)[0])
        if buf.nonfinite[r]:
            self.free.append(r)
            raise NonFiniteLogits(f"non-finite logits (NaN or Inf) in the prefill of a {len(prompt)}-token prompt: "
                                  f"the weights or activations overflowed")
        live = first not in params.stop_ids and params.max_new_tokens > 1
        buf.bonus[r] = first
        buf.produced[r] = 1
        buf.max_new[r] = params.max_new_tokens
        buf.stop_ids[r].fill_(-1)
        if params.stop_ids:
            buf.stop_ids[r, :len(params.stop_ids)] = torch.tensor(params.stop_ids, dtype=torch.int64, device=dev)
        buf.accept_len[r] = 0
        if s.dcache is not None:
            self._ingest(r, prompt, feats)
        buf.live[r] = int(live)
        if live:
            self.active.add(r)
        else:
            self.free.append(r)
        return r, first, live

    def _ingest(self, r: int, prompt: list[int], feats: torch.Tensor | None) -> None:
        """Row r's prompt into the drafter's context cache (DecodeSession._ingest for one row): all but
        the last tail = min(p, a) rows now, the tail as the first round's context.  The other rows
        ingest nothing (length 0); the rows the drafter writes past their committed length are
        overwritten before they become visible."""
        s, buf = self.session, self.session.buf
        b, dev = s.batch, s.target.device
        tail = min(len(prompt), s.a)
        head = len(prompt) - tail
        s.dcache.lens[r] = 0
        for start in range(0, head, INGEST_CHUNK):
            width = min(INGEST_CHUNK, head - start)
            ctx = torch.zeros(b, width, buf.ctx_feats.shape[2], dtype=buf.ctx_feats.dtype, device=dev)  # [b, w, F]
            toks = torch.zeros(b, width, dtype=torch.int64, device=dev)  # [b, w]
            if feats is not None:
                ctx[r] = feats[start:start + width]
            toks[r] = torch.tensor(prompt[start:start + width], dtype=torch.int64)
            lens = torch.zeros(b, dtype=torch.int32, device=dev)
            lens[r] = width
            s.drafter.draft(s.dcache, ctx, lens, buf.bonus, toks)
        buf.ctx_feats[r].zero_()
        buf.ctx_tokens[r].zero_()
        if feats is not None:
            buf.ctx_feats[r, :tail] = feats[head:]
        buf.ctx_tokens[r, :tail] = torch.tensor(prompt[head:], dtype=torch.int64)
        buf.accept_len[r] = tail

    def step(self) -> list[RowEmission]:
        """One round of every row; what each active row emitted.  Rows that finished are released."""
        s = self.session
        if self.graph is not None:
            self.graph.launch()
        else:
            s.step(self.greedy)
        rows = s.buf.out.tolist()  # [b, a + 4]: tokens | count | live | accept_len | nonfinite
        a, out = s.a, []
        for r in sorted(self.active):
            row = rows[r]
            count, live, acc, bad = row[a], bool(row[a + 1]), row[a + 2], bool(row[a + 3])
            out.append(RowEmission(r, [] if bad else row[:count], live and not bad, acc, bad))
            if bad or not live:
                self.release(r)
        return out

    def release(self, r: int) -> None:
        """Free row r (finished, or its request was cancelled): frozen from the next round on."""
        if r in self.active:
            self.active.discard(r)
            self.session.buf.live[r] = 0
            self.free.append(r)
