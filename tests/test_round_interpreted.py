"""The decode loop through the GPU path's kernels, on the CPU: every kdtree:: op's CUDA launcher (the Triton kernels,
run by Triton's interpreter) stands in for its reference, and every `x.is_cuda` branch of the Python code is taken
(benchmarks/launch_count.cuda_branches), so the fused layer glue, the drafter's kernels, tree_build / tree_accept /
kv_commit / round_emit and the TP-free greedy path run exactly as they are launched on a GPU, minus the graphs and
the MoE's CUDA C kernels (the op's reference serves it).  The tiny Kimi preset in fp32, two requests of different
lengths, greedy: AR and DDTree tokens equal each other and the reference path's.  This catches a launcher's wrong
shape, stride or dtype before a GPU is lent; the kernels' numerics are the kernel tests' business.  The same for
one rank of a TP2 plan (the vocab-parallel paths, the sharded drafter)."""

from __future__ import annotations

import json
import sys

import torch
from interpreter import interpreted, interpreter_shims

NEW_TOKENS = 5  # several DDTree rounds of the random drafter; each token is ~12 s of interpreted kernels
ON_REFERENCE = ("moe_w4a16",)  # its CUDA path launches CUDA C kernels (plugins/moe_w4a16/moe_v3.cu)


def _decode(target, drafter, prompts: list[list[int]], spec: str) -> list[list[int]]:
    from runtime.engine.engine import Engine
    eng = Engine.from_models(target, drafter if spec != "none" else None, None, spec, 16, graphs=False)
    return eng.generate_batch_ids(prompts, NEW_TOKENS, 0.0, seed=0)


def _as_launched(fn):
    """fn with tensors' own is_cuda (False) while it runs: a launcher picks the interpreter's variants (no
    libdevice, no launch options), as the kernel tests run them."""
    def run(*args, **kwargs):
        fake = torch.Tensor.__dict__.get("is_cuda")
        if fake is not None:
            del torch.Tensor.is_cuda
        try:
            return fn(*args, **kwargs)
        finally:
            if fake is not None:
                torch.Tensor.is_cuda = fake
    return run


def _worker(tp: int) -> dict:
    from benchmarks.launch_count import LaunchCount, cuda_branches
    from plugins.common.op import LIB, OPS
    from runtime.load.synthetic import draw_models
    from runtime.parallel.solo import SoloRankComm

    torch.manual_seed(0)
    comm = SoloRankComm(0, tp, torch.device("cpu")) if tp > 1 else None  # rank 0's shard, its own collectives
    target, drafter = draw_models("tiny-kimi", comm, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 11)]
    ref = {spec: _decode(target, drafter, prompts, spec) for spec in ("none", "ddtree")}
    kernels = sorted(n for n, op in OPS.items() if op.cuda_kernel is not None and n not in ON_REFERENCE)
    for name in kernels:
        LIB.impl(name, _as_launched(OPS[name].cuda_kernel), "CPU")  # the CUDA launcher on CPU tensors
    count = LaunchCount(depth=1)
    with cuda_branches(), count:
        got = {spec: _decode(target, drafter, prompts, spec) for spec in ("none", "ddtree")}
    ran = sorted({op.split("::")[1] for op, _ in count.kernels if op.startswith("kdtree::")})
    return {"reference": ref, "kernels": got, "registered": kernels, "ran": ran}


def test_decode_through_the_kernels_matches_the_reference():
    res = interpreted(__file__, "1", timeout=900)
    assert res["kernels"]["none"] == res["reference"]["none"], res
    assert res["kernels"]["ddtree"] == res["kernels"]["none"], res
    assert res["reference"]["ddtree"] == res["reference"]["none"], res
    assert all(len(t) == NEW_TOKENS for t in res["kernels"]["none"]), res
    # the round's ops all went through their launchers
    for op in ("add_rms_norm", "mla_rope_kv", "mla_q_absorb", "mla_v_absorb", "tree_verify_mla", "tree_build",
               "tree_accept", "kv_commit", "round_emit", "posterior", "drafter_attention", "kv_norm_rope_store",
               "drafter_block", "rope_cos_sin", "embed_norm_rope"):
        assert op in res["ran"] and op in res["registered"], (op, res["ran"])


def test_tp_rank_through_the_kernels_matches_the_reference():
    """Rank 0 of a TP2 plan run alone (runtime/parallel/solo.py: its collectives return its own share, so the
    tokens are that rank's model's, deterministic on both paths): the vocab-parallel embedding, the TP greedy
    token's two kernels and the sharded drafter run through their launchers."""
    res = interpreted(__file__, "2", timeout=900)
    assert res["kernels"] == res["reference"], res
    assert res["kernels"]["ddtree"] == res["kernels"]["none"], res
    for op in ("embed_range", "vocab_argmax_local", "vocab_argmax_pick", "drafter_attention", "kv_norm_rope_store"):
        assert op in res["ran"], (op, res["ran"])


if __name__ == "__main__" and "--interpreter" in sys.argv:
    interpreter_shims()
    print(json.dumps(_worker(int(sys.argv[-1]))))
