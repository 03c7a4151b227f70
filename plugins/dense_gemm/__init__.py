"""dense_gemm: tiny-M bf16 projections without cuBLAS (kdtree::skinny_linear), not wired into the runtime yet.

skinny_linear(x, w, c, out_dtype) checks its inputs, applies the small-n rule (config.declines: too few
weight-row blocks to fill the SMs without a split-K, so it returns None and the caller keeps cuBLAS), picks a
launch config (config.pick_config: the table keyed by (n, k, t bucket), else the default rule) and calls the
op: the torch reference on every device (reference.py), the Triton kernel on CUDA (kernel.py).  The rule and
the config depend on the shapes and the device's SM count only (an H200's 132 without a CUDA device), so a
CPU run plans what the H200 would.

Letters: t tokens, n output features (W's rows), k input features.
"""

from __future__ import annotations

import torch

from plugins.common.device import device_facts
from plugins.common.op import kdtree_op
from plugins.dense_gemm.config import GemmConfig, declines, pick_config
from plugins.dense_gemm.reference import skinny_linear_reference

__all__ = ["check_inputs", "skinny_linear", "skinny_linear_reference"]  # the configs: plugins.dense_gemm.config

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    """ValueError naming the tensor unless x [t, k] (unit stride along k), w [n, k] contiguous of x's dtype
    (bf16 / fp16 / fp32), c None or [t, n] (unit stride along n) of x's dtype or out_dtype, out_dtype x's
    dtype or fp32, all on one device."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"skinny_linear: x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"skinny_linear: x must be [t, k] with unit stride along k, got {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if w.dim() != 2 or w.dtype != x.dtype:
        raise ValueError(f"skinny_linear: w must be [n, k] of x's dtype {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_linear: w's k ({w.shape[1]}) must equal x's k ({x.shape[1]}): w "
                         f"{tuple(w.shape)}, x {tuple(x.shape)}")
    if not w.is_contiguous():
        raise ValueError(f"skinny_linear: w must be contiguous (row-major [n, k]), got strides {w.stride()}")
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"skinny_linear: out_dtype must be x's dtype {x.dtype} or float32, got {out_dtype}")
    t, n = x.shape[0], w.shape[0]
    if c is not None and (c.dim() != 2 or tuple(c.shape) != (t, n) or (n > 1 and c.stride(1) != 1)
                          or c.dtype not in (x.dtype, out_dtype)):
        raise ValueError(f"skinny_linear: c must be [{t}, {n}] with unit stride along n, of {x.dtype} or "
                         f"{out_dtype}, got {tuple(c.shape)} strides {c.stride()} {c.dtype}")
    if w.device != x.device or (c is not None and c.device != x.device):
        raise ValueError(f"skinny_linear: x, w and c must share a device, got x on {x.device}, w on {w.device}"
                         + (f", c on {c.device}" if c is not None else ""))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, config: GemmConfig | None = None) -> torch.Tensor | None:
    """x [t, k] . w [n, k]^T (+ c [t, n]) -> [t, n] out_dtype (default x's), fp32 accumulation rounded once;
    None when the small-n rule declines (config.declines; the caller keeps cuBLAS).  config: a launch config
    instead of the table's (the benchmark's sweep, the tests), which also bypasses the rule."""
    out_dtype = out_dtype or x.dtype
    check_inputs(x, w, c, out_dtype)
    n, k = w.shape
    sms = device_facts(x.device).sms
    if config is None:
        if declines(n, sms):
            return None
        config = pick_config(n, k, x.shape[0], sms)
    return skinny_linear_op(x, w, c, out_dtype, config.block_m, config.block_n, config.block_k, config.stages,
                            config.warps)


@kdtree_op("skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_dtype: torch.dtype, block_m: int,
                     block_n: int, block_k: int, stages: int, warps: int) -> torch.Tensor:
    """The reference (every device but CUDA); the launch config is the CUDA kernel's only."""
    return skinny_linear_reference(x, w, c, out_dtype)


@skinny_linear_op.register_fake
def _(x, w, c, out_dtype, block_m, block_n, block_k, stages, warps):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


@skinny_linear_op.register_kernel("cuda")
def _skinny_linear_cuda(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_dtype: torch.dtype,
                        block_m: int, block_n: int, block_k: int, stages: int, warps: int) -> torch.Tensor:
    from plugins.dense_gemm.kernel import skinny_linear_triton
    y = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)  # [t, n]
    skinny_linear_triton(x, w, c, y, GemmConfig(block_m, block_n, block_k, stages, warps))
    return y
