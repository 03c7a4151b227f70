"""Speculative decoding: its configuration, its stats, and the one-call entry points.

Modes: `ddtree` (the B best prefixes of the draft, K = B candidates per depth), `chain` (DFlash's
single path: one candidate per depth, B = D).  A round for b requests, each with its own cache
length and tree (runtime/round.py's spec_round):

  draft       drafter(context features of last round's committed tokens, bonus) -> logits [b, D, V]
  tree_build  -> tokens, parents, depth, positions [b, N], mask [b, N, w]      (N = B + 1, root = bonus)
  verify      target.forward over the N tree tokens -> hidden, features [b, N, .]; posterior [b, N]
  tree_accept -> accept_idx [b, D+1], accept_len [b], next bonus [b]
  kv_commit   accepted rows -> latent cache; their features -> next round's drafter context

Emitted per round and request: the accepted node tokens, then the bonus (accept_len tokens).

The loop is runtime/session.py's DecodeSession, the one the Engine runs; generate_spec and
generate_spec_batch run it eagerly on a session sized for the call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from runtime.generate import SamplingParams, Stats
from runtime.model import TargetModel
from runtime.round import STAGES


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
    """Stats of a decode loop (AR or speculative): plus rounds, tau, the accept-length histogram and
    per-stage time (None where the stages were not timed: replayed graphs); the host loop's numbers
    go to `extra`."""

    def __init__(self):
        super().__init__()
        self.accept_lens: list[int] = []
        self.stage_s = {k: 0.0 for k in STAGES}
        self.timed_stages = False

    def as_dict(self) -> dict:
        d = super().as_dict()
        rounds = len(self.accept_lens)
        d.update(rounds=rounds, tau=round(sum(self.accept_lens) / rounds, 4) if rounds else None,
                 accept_len_histogram=dict(sorted(Counter(self.accept_lens).items())),
                 stage_ms={k: round(1e3 * v, 3) for k, v in self.stage_s.items()} if self.timed_stages else None)
        return d


def generate_spec(target: TargetModel, drafter, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig,
                  stats: SpecStats | None = None) -> Iterator[int]:
    """Stream the new tokens of one request decoded speculatively."""
    from runtime.session import decode_rounds  # session.py builds on this module

    stats = stats if stats is not None else SpecStats()
    for per_request in decode_rounds(target, drafter, spec.mode, spec.budget, [prompt_ids], params, stats):
        yield from per_request[0]


def generate_spec_batch(target: TargetModel, drafter, prompts: list[list[int]], params: SamplingParams,
                        spec: SpecConfig, stats: SpecStats | None = None) -> list[list[int]]:
    """Decode a batch of requests together (each with its own cache length and tree); returns the
    new tokens of each."""
    from runtime.session import collect, decode_rounds  # session.py builds on this module

    stats = stats if stats is not None else SpecStats()
    return collect(decode_rounds(target, drafter, spec.mode, spec.budget, prompts, params, stats), len(prompts))
