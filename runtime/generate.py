"""Prefill and plain autoregressive (AR) decoding with the latent cache, one request at a time.

Both go through TargetModel.forward + kv_commit: a prefill chunk is a chain of n tokens committed
whole, an AR step a chain of one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from plugins.bitmask import causal_mask
from plugins.kv_commit import kv_commit
from runtime.cache import LatentCache
from runtime.model import TargetModel
from runtime.sampling import sample


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


@dataclass
class Stats:
    """Counters and timings of one generation; `as_dict` is what `--json` prints."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
             "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
             "decode_tokens_per_s": round(self.new_tokens / self.decode_s, 3) if self.decode_s > 0 else None}
        d.update(self.extra)
        return d


def commit_chain(cache: LatentCache, n: int) -> None:
    """Append all n scratch rows (a chain) of request 0.. to the committed cache."""
    b = cache.lens.shape[0]
    idx = torch.arange(n, dtype=torch.int32, device=cache.lens.device).expand(b, n).contiguous()
    kv_commit(cache.kv, cache.lens, cache.scratch, idx, torch.full((b,), n, dtype=torch.int32, device=idx.device))


def prefill(model: TargetModel, cache: LatentCache, prompt: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prompt [p] int64 for request 0 of a batch-1 cache -> (last hidden [d], features [p, f*d] or None)."""
    chunk = cache.tokens_per_forward
    p = prompt.shape[0]
    if p == 0:
        raise ValueError("prompt is empty: give at least one token")
    if p + 1 > cache.capacity:
        raise ValueError(f"prompt of {p} tokens does not fit the cache capacity {cache.capacity}")
    feats = []
    hidden = None
    for start in range(0, p, chunk):
        ids = prompt[start:start + chunk][None]  # [1, n]
        n = ids.shape[1]
        positions = cache.lens[:, None].long() + torch.arange(n, device=ids.device)  # [1, n]
        hidden, f = model.forward(ids, positions, cache, causal_mask(1, n, ids.device))
        commit_chain(cache, n)
        if f is not None:
            feats.append(f[0])
    return hidden[0, -1], (torch.cat(feats) if feats else None)


def prefill_requests(model: TargetModel, cache: LatentCache, prompts: list[list[int]]
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Prefill request r of a batch cache with prompts[r] -> (last hidden [b, d], features [p_r, f] per request)."""
    last, feats = [], []
    for r, prompt in enumerate(prompts):
        view = LatentCache(cache.kv[:, r:r + 1], cache.lens[r:r + 1], cache.scratch[:, r:r + 1])
        h, f = prefill(model, view, torch.tensor(prompt, dtype=torch.long, device=model.device))
        last.append(h)
        feats.append(f)
    return torch.stack(last), feats


def ar_rounds(model: TargetModel, prompts: list[list[int]], params: SamplingParams, stats: Stats,
              chunk: int = 256) -> Iterator[list[list[int]]]:
    """Plain AR for a batch of requests: yield, per step, the token each request emits (none once
    it has finished: stop token or max_new_tokens); finished requests commit nothing."""
    device = model.device
    b = len(prompts)
    longest = max(len(p) for p in prompts)
    cache = model.new_cache(b, longest + params.max_new_tokens + 1, min(chunk, longest))
    gen = torch.Generator(device=device).manual_seed(params.seed)
    stats.prompt_tokens = sum(len(p) for p in prompts)
    t0 = time.perf_counter()
    hidden, _ = prefill_requests(model, cache, prompts)  # [b, d]
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = causal_mask(b, 1, device)
    idx = torch.zeros(b, 1, dtype=torch.int32, device=device)
    done = [False] * b
    produced = [0] * b
    while True:
        token = sample(model.logits(hidden), params.temperature, gen)  # [b]
        emitted = []
        for r, t in enumerate(token.tolist()):
            if done[r]:
                emitted.append([])
                continue
            produced[r] += 1
            done[r] = t in params.stop_ids or produced[r] >= params.max_new_tokens
            emitted.append([t])
        stats.new_tokens += sum(len(e) for e in emitted)
        stats.decode_s = time.perf_counter() - t0
        yield emitted
        if all(done):
            break
        h, _ = model.forward(token[:, None], cache.lens[:, None].long(), cache, one)
        live = torch.tensor([0 if d else 1 for d in done], dtype=torch.int32, device=device)
        kv_commit(cache.kv, cache.lens, cache.scratch, idx, live)
        hidden = h[:, -1]


def generate_ar(model: TargetModel, prompt_ids: list[int], params: SamplingParams, stats: Stats | None = None
                ) -> Iterator[int]:
    """Stream the new tokens of one request (plain AR)."""
    if params.max_new_tokens == 0:
        return
    for step in ar_rounds(model, [prompt_ids], params, stats if stats is not None else Stats()):
        yield from step[0]


def generate_ar_batch(model: TargetModel, prompts: list[list[int]], params: SamplingParams,
                      stats: Stats | None = None) -> list[list[int]]:
    """Plain AR for a batch of requests decoded together; returns each request's new tokens."""
    outs: list[list[int]] = [[] for _ in prompts]
    if params.max_new_tokens == 0:
        return outs
    for step in ar_rounds(model, prompts, params, stats if stats is not None else Stats()):
        for r, toks in enumerate(step):
            outs[r] += toks
    return outs
