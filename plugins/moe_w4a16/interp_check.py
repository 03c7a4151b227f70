"""Run the moe_w4a16 Triton path under TRITON_INTERPRET=1 on CPU for a few tiny cases; print JSON.

Used by tests/test_moe_w4a16.py (`python -m plugins.moe_w4a16.interp_check`) in a subprocess, so the
interpreter setting never leaks into other test modules.  Each case compares the kernel with the
reference computed in fp64 on the same (dequantised) experts and routing.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from build_pipeline.moe_layout import dequantize_kernel_layout, padded_k  # noqa: E402
from plugins.moe_w4a16 import experts_reference, route_reference  # noqa: E402
from plugins.moe_w4a16.launch import KernelConfig, moe_w4a16_triton  # noqa: E402

SPLIT3 = KernelConfig(bm=16, bn1=16, bn2=32, split=2)  # 3 k-blocks over 2 splits: the last split is half masked
LOOP = KernelConfig(bm=16, bn1=16, bn2=32, mt=1)  # one token tile in the grid: a hot expert's tiles loop
TILE = KernelConfig(bm=16, bn1=16, bn2=32, split=2, scale_tile=True)  # [BN, 8] scale tiles, row-major scales
EXPERT_LOOP = KernelConfig(bm=16, bn1=16, bn2=32, grid_e=3)  # 3 programs per row block loop over ~8 experts

# name: (t, e, d, i, k, n_group, topk_group, e_start, e_local, int4, dtype, hot expert or None[, config])
CASES = {
    "t1_int4_bf16": (1, 8, 64, 32, 2, 1, 1, 0, 8, True, torch.bfloat16, None),
    "t5_grouped_int4_bf16": (5, 8, 64, 32, 2, 2, 1, 0, 8, True, torch.bfloat16, None),
    "t3_ep_int4_fp32": (3, 8, 96, 64, 2, 1, 1, 2, 4, True, torch.float32, None),
    "t4_dense_bf16": (4, 8, 64, 32, 2, 2, 2, 0, 8, False, torch.bfloat16, None),
    "t20_hot_expert_int4_fp32": (20, 8, 64, 32, 2, 1, 1, 0, 8, True, torch.float32, 3),
    "t3_split_k_int4_fp32": (3, 8, 520, 32, 2, 1, 1, 0, 8, True, torch.float32, None, SPLIT3),
    "t3_split_k_dense_fp32": (3, 8, 520, 32, 2, 1, 1, 0, 8, False, torch.float32, None, SPLIT3),
    "t40_hot_loop_int4_fp32": (40, 8, 64, 32, 2, 1, 1, 0, 8, True, torch.float32, 5, LOOP),
    "t3_scale_tile_int4_fp32": (3, 8, 520, 32, 2, 1, 1, 0, 8, True, torch.float32, None, TILE),
    "t20_expert_loop_int4_fp32": (20, 8, 64, 32, 2, 1, 1, 0, 8, True, torch.float32, 3, EXPERT_LOOP),
}


def run_case(t, e, d, i, k, n_group, topk_group, e_start, e_local, int4, dtype, hot, cfg=None, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if hot is not None:
        logits[:, hot] += 8.0  # every token picks `hot`: its list is longer than one tile of 16
    bias = torch.randn(e, generator=g) * 0.1
    if int4:
        w13 = torch.randint(-2**31, 2**31 - 1, (e_local, 2 * i, padded_k(d) // 8), generator=g, dtype=torch.int32)
        w2 = torch.randint(-2**31, 2**31 - 1, (e_local, d, padded_k(i) // 8), generator=g, dtype=torch.int32)
        s13 = (torch.rand(e_local, padded_k(d) // 32, 2 * i, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
        s2 = (torch.rand(e_local, padded_k(i) // 32, d, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
        s13[:, d // 32:] = 0  # the padding groups of the kernel layout hold scale 0
        s2[:, i // 32:] = 0
        w13d, w2d = dequantize_kernel_layout(w13, s13, d), dequantize_kernel_layout(w2, s2, i)
    else:
        w13 = (torch.randn(e_local, 2 * i, d, generator=g) * 0.1).to(dtype)
        w2 = (torch.randn(e_local, d, i, generator=g) * 0.1).to(dtype)
        s13 = s2 = None
        w13d, w2d = w13.float(), w2.float()
    cfg = cfg or KernelConfig(bm=16, bn1=16, bn2=32)
    if int4 and cfg.scale_tile:  # the same scales stored row-major [e, n, g], viewed as [e, g, n]
        s13, s2 = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (s13, s2))
    y = moe_w4a16_triton(x, logits, bias, w13, s13, w2, s2, k, n_group, topk_group, True, 2.5, e_start, cfg)
    idx, tw = route_reference(logits, bias, k, n_group, topk_group, True, 2.5)
    ref = experts_reference(x.double(), idx, tw.double(), w13d.double(), w2d.double(), e_start)
    rel = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return {"rel": rel, "finite": bool(torch.isfinite(y).all()), "dtype": str(dtype), "shape": list(y.shape)}


def main(names: list[str]) -> None:
    out = {n: run_case(*CASES[n]) for n in (names or CASES)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
