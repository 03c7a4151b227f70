"""budget_choice: budget auto's per-round bucket choice (kdtree::budget_select) and per-bucket calibration
(kdtree::budget_observe) as two ops: the torch reference (reference.py; every device, the CPU path) and one
Triton program each on CUDA (kernel.py), so a captured round spends two launches on them.  State and meaning:
runtime/decode/budget.py (BucketChoice holds the tensors)."""

from __future__ import annotations

import torch

from plugins.budget_choice.reference import (
    DECAY,
    S_MAX,
    S_MIN,
    calibration,
    choose,
    expected_tokens,
    extra_tokens,
    observe_reference,
    select_reference,
)
from plugins.common.op import kdtree_op

__all__ = [
    "DECAY",
    "S_MAX",
    "S_MIN",
    "budget_observe",
    "budget_select",
    "calibration",
    "choose",
    "expected_tokens",
    "extra_tokens",
]


@kdtree_op("budget_select", mutates_args=("value", "hint", "extra", "pick", "hot"))
def budget_select(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor, seen: torch.Tensor,
                  covered: torch.Tensor, force: torch.Tensor, cap_cost: torch.Tensor, value: torch.Tensor,
                  hint: torch.Tensor, extra: torch.Tensor, pick: torch.Tensor, hot: torch.Tensor, cap: int,
                  min_cap: int) -> None:
    """This round's bucket (pick, hot) among the buckets up to `cap` (reference.py)."""
    select_reference(scores, live, sizes, seen, covered, force, cap_cost, value, hint, extra, pick, hot, cap,
                     min_cap)


@budget_select.register_kernel("cuda")
def _(scores, live, sizes, seen, covered, force, cap_cost, value, hint, extra, pick, hot, cap, min_cap):
    from plugins.budget_choice.kernel import select_triton
    select_triton(scores, live, sizes, seen, covered, force, cap_cost, value, hint, extra, pick, hot, cap, min_cap,
                  DECAY, S_MIN, S_MAX)


@kdtree_op("budget_observe", mutates_args=("seen", "covered"))
def budget_observe(accept_len: torch.Tensor, accept_idx: torch.Tensor, sizes: torch.Tensor, verified: int,
                   extra: torch.Tensor, seen: torch.Tensor, covered: torch.Tensor) -> None:
    """The calibration after a round that verified `verified` nodes (reference.py)."""
    observe_reference(accept_len, accept_idx, sizes, verified, extra, seen, covered)


@budget_observe.register_kernel("cuda")
def _(accept_len, accept_idx, sizes, verified, extra, seen, covered):
    from plugins.budget_choice.kernel import observe_triton
    observe_triton(accept_len, accept_idx, sizes, verified, extra, seen, covered, DECAY)
