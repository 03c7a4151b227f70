"""Sampling parameters, generation stats, prefill, and the plain autoregressive (AR) entry points.

Prefill goes through TargetModel.forward + kv_commit, a chunk of n prompt tokens being a chain
committed whole; every decode loop (AR and speculative, Engine or not) starts with it.  The AR
loop itself is runtime/session.py's DecodeSession (an AR step is runtime/round.py's ar_step, a
chain of one); generate_ar and generate_ar_batch run it eagerly on a session sized for the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from plugins.bitmask import causal_mask
from plugins.kv_commit import kv_commit
from runtime.cache import LatentCache
from runtime.model import TargetModel

if TYPE_CHECKING:
    from runtime.spec import SpecStats


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


def generate_ar(model: TargetModel, prompt_ids: list[int], params: SamplingParams,
                stats: SpecStats | None = None) -> Iterator[int]:
    """Stream the new tokens of one request (plain AR)."""
    from runtime.session import decode_rounds  # session.py builds on this module's prefill
    from runtime.spec import SpecStats

    stats = stats if stats is not None else SpecStats()
    for per_request in decode_rounds(model, None, "none", 0, [prompt_ids], params, stats):
        yield from per_request[0]


def generate_ar_batch(model: TargetModel, prompts: list[list[int]], params: SamplingParams,
                      stats: SpecStats | None = None) -> list[list[int]]:
    """Plain AR for a batch of requests decoded together; returns each request's new tokens."""
    from runtime.session import collect, decode_rounds  # session.py builds on this module's prefill
    from runtime.spec import SpecStats

    stats = stats if stats is not None else SpecStats()
    return collect(decode_rounds(model, None, "none", 0, prompts, params, stats), len(prompts))
