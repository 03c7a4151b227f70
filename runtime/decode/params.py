"""What a generation asks for, validated once: SamplingParams (per request) and SpecConfig (the mode).

Modes: `none` (plain AR), `chain` (DFlash's single path: one candidate per depth, B = D) and
`ddtree` (the B best prefixes of the draft, K = B candidates per depth).  DDTree's budget is fixed
(`--budget B`) or chosen per round (`--budget auto`, `auto:B_MAX`: the tree is built at B_MAX and each
round verifies the bucket of it that maximises the expected tokens per second under a cost curve,
runtime/decode/budget.py).  Errors are InvalidParam naming the API field (max_new_tokens,
temperature, spec, budget); the CLI alone maps them to its flag names.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.decode.budget import CostCurve

MODES = ("none", "chain", "ddtree")
AUTO_MAX_BUDGET = 256  # `--budget auto`: the largest bucket (the tree tree_build builds every round)
CPU_BUDGET = 16  # the default fixed budget where auto is not the default


def default_budget(device) -> "int | str":
    """The budget when none is asked for: "auto" on CUDA (each round verifies the bucket a cost curve measured on
    this GPU says pays most; benchmarks/results/budget-auto.json: within 2.5 % of the best fixed budget on the K2.6
    rank's curves, which no fixed default is on every workload), CPU_BUDGET elsewhere (an eager CPU round's time
    is noise on a shared machine, so a curve measured there would choose at random)."""
    return "auto" if str(device).startswith("cuda") else CPU_BUDGET


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
    budget: int = 16  # tree nodes besides the root (ddtree); with auto the largest bucket
    auto: bool = False  # ddtree: choose the bucket per round (runtime/decode/budget.py)
    curve: CostCurve | None = None  # auto: the cost curve to choose with (None: stored or measured)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidParam("spec", f"spec must be none, chain or ddtree, got {self.mode!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise InvalidParam("budget", f"budget must be an integer, auto or auto:N, got {self.budget!r}")
        if self.mode == "ddtree" and self.budget < 1:
            raise InvalidParam("budget", f"budget must be >= 1, got {self.budget}")
        if self.auto and self.mode != "ddtree":
            raise InvalidParam("budget", f"budget auto applies to spec ddtree, not {self.mode}")
        if self.curve is not None and not self.auto:
            raise InvalidParam("budget", "a cost curve applies to budget auto only")

    @classmethod
    def of(cls, mode: str, budget: "int | str" = 16, curve: CostCurve | None = None) -> "SpecConfig":
        """budget: an integer, "auto" (largest bucket AUTO_MAX_BUDGET) or "auto:N" (largest bucket N)."""
        size, auto = parse_budget(budget)
        return cls(mode, size, auto, curve)

    @property
    def budget_label(self) -> "int | str":
        """The budget as the API and the CLI spell it: B, or auto:B_MAX."""
        return f"auto:{self.budget}" if self.auto else self.budget

    @property
    def bucket(self) -> tuple[str, int]:
        """(mode, budget) with the budget only where it matters (with auto: the largest bucket)."""
        return self.mode, self.budget if self.mode == "ddtree" else 0

    @property
    def key(self) -> tuple:
        """What decides a decode session: the bucket, whether the budget is auto, and the curve it was given."""
        return (*self.bucket, self.auto, self.curve)

    def tree_shape(self, depth: int, vocab: int) -> tuple[int, int]:
        """(budget B, candidates per depth K) for drafts of `depth` positions."""
        if self.mode == "chain":
            return depth, 1
        k = min(self.budget, vocab)
        if depth == 1 and self.budget > vocab:
            raise InvalidParam("budget", f"budget {self.budget} exceeds the {vocab} prefixes of a depth-1 draft")
        return self.budget, k


def parse_budget(value: "int | str") -> tuple[int, bool]:
    """(largest budget, auto) from an integer, "B", "auto" or "auto:B"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, False
    text = str(value).strip().lower()
    if text == "auto":
        return AUTO_MAX_BUDGET, True
    head, sep, tail = text.partition(":")
    try:
        if head == "auto" and tail:
            return int(tail), True
        if not sep:
            return int(text), False
    except ValueError:
        pass
    raise InvalidParam("budget", f"budget must be an integer, auto or auto:N, got {value!r}")
