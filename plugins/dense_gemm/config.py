"""Launch configurations of the skinny GEMM: a table keyed by (n, k, t bucket), a default rule, the
alternatives benchmarks/dense_gemm.py --sweep tries, and the small-n rule that declines (the caller keeps
cuBLAS).  NOTES.md says why these numbers.

One program owns BLOCK_N weight rows and BLOCK_M tokens and streams its rows over the whole k in BLOCK_K
slices, `stages` slices in flight (Triton's software pipeline), so the grid is cdiv(t, BLOCK_M) x
cdiv(n, BLOCK_N) and a row's sum runs in one fixed order whatever t is (for one config).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

STAGE_BYTES = 32 * 1024  # shared memory of one pipeline slice, (BLOCK_N + BLOCK_M) * BLOCK_K * 2 at most
IN_FLIGHT_BYTES = 48 * 1024  # weight bytes a program keeps in flight (stages - 1 slices): ~ H200 HBM
#                              bandwidth x loaded latency / SMs = 4.25 TB/s x ~1.2 us / 132 ~ 39 KB, rounded up
MIN_ROW_BLOCKS = 0.5  # decline when cdiv(n, 16) < this fraction of the SMs (n = 896 of a 132-SM H200: 56 < 66)
T_BUCKETS = (16, 32, 64, 1 << 30)  # a t bucket is the first bound >= t; the last holds every larger t
# One TP8 rank of K2.6 per layer (and the lm_head slice once per step): name -> (n, k, output "model" (bf16) or
# "fp32", whether c [t, n] is accumulated).  The tests and benchmarks/dense_gemm.py use these.
K26_SHAPES: dict[str, tuple[int, int, str, bool]] = {
    "qkv_a": (2112, 7168, "model", False),  # q_a and kv_a stacked (runtime/load/artifact.stack_rows)
    "q_b": (1536, 1536, "model", False),
    "o_proj": (7168, 1024, "model", False),
    "router_gate_up": (896, 7168, "fp32", False),  # router and shared expert's gate_up stacked
    "shared_down": (7168, 256, "model", True),  # accumulates into the routed experts' output
    "lm_head": (20480, 7168, "fp32", False),
}


@dataclass(frozen=True)
class GemmConfig:
    """One launch: block_m tokens x block_n weight rows per program, block_k columns per pipeline slice."""
    block_m: int = 16
    block_n: int = 16
    block_k: int = 512
    stages: int = 4
    warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "warps"):
            v = getattr(self, name)
            if v < (1 if name == "warps" else 16) or v & (v - 1):
                raise ValueError(f"GemmConfig: {name} must be a power of two (>= 16 for blocks: tl.dot's "
                                 f"minimum), got {v}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"GemmConfig: stages must be in 1..8, got {self.stages}")

    def programs(self, n: int, t: int) -> int:
        return triton.cdiv(n, self.block_n) * triton.cdiv(t, self.block_m)


def t_bucket(t: int) -> int:
    """The table's t key: 16, 32, 64, or the last bucket for t > 64."""
    return next(b for b in T_BUCKETS if t <= b)


# Measured winners, (n, k, t bucket) -> GemmConfig.  Empty until benchmarks/dense_gemm.py --sweep has run on
# the H200: until then every shape takes default_config's rule (the prediction NOTES.md writes down).
TABLE: dict[tuple[int, int, int], GemmConfig] = {}


def declines(n: int, sms: int) -> bool:
    """The small-n rule: too few weight-row blocks (of the smallest, 16) to keep the SMs streaming without a
    split-K, so skinny_linear returns None and the caller keeps cuBLAS (NOTES.md: why no split-K)."""
    return triton.cdiv(n, 16) < MIN_ROW_BLOCKS * sms


def _fit(block_m: int, block_n: int, k: int) -> GemmConfig:
    """block_k: the largest of 512 / 256 / 128 (or k's power of two) whose slice fits STAGE_BYTES; stages:
    enough slices for IN_FLIGHT_BYTES of weights in flight, within 3..5."""
    kp = max(16, triton.next_power_of_2(k))
    block_k = next((bk for bk in (512, 256, 128) if bk <= kp and (block_m + block_n) * bk * 2 <= STAGE_BYTES),
                   min(kp, 128))
    stages = min(5, max(3, 1 + triton.cdiv(IN_FLIGHT_BYTES, block_n * block_k * 2)))
    return GemmConfig(block_m, block_n, block_k, stages, 4)


def default_config(n: int, k: int, t: int, sms: int) -> GemmConfig:
    """block_m: t's power of two within 16..64; block_n: the largest of 64 / 32 / 16 that still gives >= sms
    programs (else 16: as many as there can be)."""
    block_m = min(64, max(16, triton.next_power_of_2(t)))
    block_n = next((bn for bn in (64, 32, 16) if triton.cdiv(n, bn) * triton.cdiv(t, block_m) >= sms), 16)
    return _fit(block_m, block_n, k)


def pick_config(n: int, k: int, t: int, sms: int) -> GemmConfig:
    """The table's entry for (n, k, t bucket), else default_config."""
    return TABLE.get((n, k, t_bucket(t))) or default_config(n, k, t, sms)


def candidates(n: int, k: int, t: int, sms: int) -> list[GemmConfig]:
    """What --sweep times for one (n, k, t): the default first, then block_m x block_n x (block_k, stages)
    alternatives around it (within shared memory: (block_m + block_n) * block_k * 2 * stages <= 160 KB), <= 19."""
    out = [default_config(n, k, t, sms)]
    kp = max(16, triton.next_power_of_2(k))
    bms = sorted({16, min(64, max(16, triton.next_power_of_2(t)))})
    for bm in bms:
        for bn in (16, 32, 64):
            for bk, stages in ((128, 5), (256, 4), (512, 3)):
                if bk > kp and bk != 128 or (bm + bn) * bk * 2 * stages > 160 * 1024:
                    continue
                cfg = GemmConfig(bm, bn, min(bk, kp), stages, 4)
                if cfg not in out:
                    out.append(cfg)
    return out
