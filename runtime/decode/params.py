"""What a generation asks for, validated once: SamplingParams (per request) and SpecConfig (the mode).

Modes: `none` (plain AR), `chain` (DFlash's single path: one candidate per depth, B = D) and
`ddtree` (the B best prefixes of the draft, K = B candidates per depth).  Errors are InvalidParam
naming the API field (max_new_tokens, temperature, spec, budget); the CLI alone maps them to its
flag names.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "chain", "ddtree")


class InvalidParam(ValueError):
    """A decode argument out of range; `name` is the API field it concerns."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InvalidParam("max_new_tokens", f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN fails too
            raise InvalidParam("temperature", f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63:
            raise InvalidParam("seed", f"seed must be an integer in [-2**63, 2**63) (the generator's int64 state), "
                                       f"got {self.seed!r}")


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "ddtree"  # "none" | "chain" | "ddtree"
    budget: int = 16  # tree nodes besides the root (ddtree)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidParam("spec", f"spec must be none, chain or ddtree, got {self.mode!r}")
        if self.mode == "ddtree" and self.budget < 1:
            raise InvalidParam("budget", f"budget must be >= 1, got {self.budget}")

    @property
    def bucket(self) -> tuple[str, int]:
        """(mode, budget) with the budget only where it matters: the key of a decode session."""
        return self.mode, self.budget if self.mode == "ddtree" else 0

    def tree_shape(self, depth: int, vocab: int) -> tuple[int, int]:
        """(budget B, candidates per depth K) for drafts of `depth` positions."""
        if self.mode == "chain":
            return depth, 1
        k = min(self.budget, vocab)
        if depth == 1 and self.budget > vocab:
            raise InvalidParam("budget", f"budget {self.budget} exceeds the {vocab} prefixes of a depth-1 draft")
        return self.budget, k
