"""How many fresh random cases a GPU test draws: the full count (the evidence behind the kernels' claims), or with
KDTREE_GPU_QUICK=1 a fifth of it (at least 20), so that every GPU test file fits one device call
(tests/run_gpu_parallel.sh) when a session only needs to re-check that nothing broke.  Most of a GPU test's time is
Triton compiling the variants its random shapes reach, which grows with the case count."""

from __future__ import annotations

import os


def gpu_cases(full: int) -> int:
    """full, or max(20, full // 5) with KDTREE_GPU_QUICK=1 (never more than full)."""
    if os.environ.get("KDTREE_GPU_QUICK", "0") != "0":
        return min(full, max(20, full // 5))
    return full
