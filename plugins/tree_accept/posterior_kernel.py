"""Triton kernel of the posterior op (see posterior.py): per row, argmax of logits (greedy) or of
logits * inv_temp + Gumbel noise (SAMPLE; inv_temp read from device memory), ties to the lowest id; with
FLAG, a row holding a NaN or Inf logit sets its request's flag to 1.

The noise is plugins/common/rng.py's counter-based uniform, bit for bit: row `row` belongs to request
q = row // rows_per_req; with (seed, counter) = state[q], key = mix(seed * G + counter) and
u[i] = ((mix(key + (i + 1) * G) >> 40) + 0.5) / 2^24 for the element's index within the request,
i = (row - q * rows_per_req) * V + col (mix = the splitmix64 finaliser, G = the golden-ratio increment,
all arithmetic modulo 2^64).  So the GPU draws the same samples as plugins.common.rng.choose on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.pdl import pdl_prologue


@triton.jit
def _mix(z):
    """splitmix64 finaliser on uint64 (multiplications wrap modulo 2^64, shifts are logical)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def posterior_kernel(logits_ptr, out_ptr, state_ptr, inv_temp_ptr, flag_ptr, v, s_row, rows_per_req,
                     SAMPLE: tl.constexpr, FLAG: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    req = row // rows_per_req
    base = logits_ptr + row * s_row
    lane = tl.arange(0, BLOCK_V).to(tl.int64)
    best = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)  # per-lane running max
    best_i = lane  # and the lowest column reaching it
    if SAMPLE:
        seed = tl.load(state_ptr + 2 * req).to(tl.uint64, bitcast=True)
        counter = tl.load(state_ptr + 2 * req + 1).to(tl.uint64, bitcast=True)
        key = _mix(seed * 0x9E3779B97F4A7C15 + counter)
        inv_t = tl.load(inv_temp_ptr + req)
    bad = tl.zeros((BLOCK_V,), dtype=tl.int1)  # a NaN or Inf logit seen (FLAG)
    start = row * 0  # int64; a while loop (a runtime trip count) also runs in the interpreter
    while start < v:
        cols = start + lane  # [BLOCK_V]
        inside = cols < v
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
        if FLAG:
            bad = bad | (inside & ((x != x) | (x == float("inf")) | (x == float("-inf"))))
        if SAMPLE:
            inside_req = (row - req * rows_per_req) * v + cols  # [BLOCK_V] element index within the request
            flat = (inside_req + 1).to(tl.uint64, bitcast=True)
            bits = _mix(key + flat * 0x9E3779B97F4A7C15)  # [BLOCK_V]
            u = ((bits >> 40).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 24 bits, strictly inside (0, 1)
            x = tl.where(inside, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
        best, best_i = argmax_step(x, cols, best, best_i)
        start += BLOCK_V
    top, pick = argmax_final(best, best_i, v)
    tl.store(out_ptr + row, pick)
    if FLAG:  # the request's flag: set by any of its rows, never cleared here (every writer writes 1)
        tl.store(flag_ptr + req, 1, mask=tl.max(bad.to(tl.int32), axis=0) != 0)


@triton.jit
def argmax_step(x, cols, best, best_i):
    """One chunk of a row's running argmax: per lane, x [BLOCK] at columns cols replaces (best, best_i) where it
    is strictly larger (an earlier column keeps a tie)."""
    better = x > best
    return tl.where(better, x, best), tl.where(better, cols, best_i)


@triton.jit
def argmax_final(best, best_i, v):
    """The row's (max, lowest column holding it) from the per-lane running values, the column below v."""
    top = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == top, best_i, v), axis=0)
    return top, tl.minimum(pick, v - 1)
