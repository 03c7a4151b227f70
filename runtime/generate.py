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


def generate_ar(model: TargetModel, prompt_ids: list[int], params: SamplingParams, stats: Stats | None = None,
                chunk: int = 256) -> Iterator[int]:
    """Yield new token ids one by one (plain AR); stops after a stop token or max_new_tokens."""
    stats = stats if stats is not None else Stats()
    device = model.device
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    cache = model.new_cache(1, len(prompt_ids) + params.max_new_tokens + 1, min(chunk, max(len(prompt_ids), 1)))
    gen = torch.Generator(device=device).manual_seed(params.seed)
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    hidden, _ = prefill(model, cache, prompt)
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = causal_mask(1, 1, device)
    for step in range(params.max_new_tokens):
        token = sample(model.logits(hidden[None]), params.temperature, gen)  # [1]
        tid = int(token)
        stats.new_tokens += 1
        stats.decode_s = time.perf_counter() - t0
        yield tid
        if tid in params.stop_ids or step + 1 == params.max_new_tokens:
            break
        positions = cache.lens[:, None].long()  # [1, 1]
        h, _ = model.forward(token[None].view(1, 1), positions, cache, one)
        commit_chain(cache, 1)
        hidden = h[0, -1]
    stats.decode_s = time.perf_counter() - t0
