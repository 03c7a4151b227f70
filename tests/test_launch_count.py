"""benchmarks/launch_count.py: the CPU model of a round's launches sees every op of the round, and the round
has the properties a captured graph needs (no value read back to the host) and no dtype conversion in the AR
step (every cast there is folded into a kernel: a stray one costs a launch per layer, as acc(x).dtype did)."""

import torch

from benchmarks.launch_count import KDTREE_LAUNCHES, LaunchCount, count_preset, cuda_branches


def test_the_counter_sees_views_as_free_and_kdtree_ops_by_their_launches():
    from plugins.layer_fusion import rms_norm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    c = LaunchCount()
    with cuda_branches(), c:
        y = x.view(3, 8, 8).transpose(1, 2)  # views: no kernel
        z = y.contiguous()  # a copy: one kernel
        n = rms_norm(x, w, 1e-6)  # the fused kernel on CUDA: one launch
    assert c.by_op() == {"aten::clone": 1, "kdtree::rms_norm": 1}
    assert torch.equal(z, x.view(3, 8, 8).transpose(1, 2)) and n.shape == x.shape
    assert all(v >= 1 for v in KDTREE_LAUNCHES.values())


def test_a_host_read_is_listed_apart():
    c = LaunchCount()
    with c:
        torch.ones(4).sum().item()
    assert sum(c.host_reads.values()) == 1 and c.by_op() == {"aten::ones": 1, "aten::sum": 1}


def test_the_tiny_rounds_read_nothing_back_and_the_ar_step_converts_nothing():
    res = count_preset("tiny-kimi", None, 64, 4, depth=1)
    for name, r in res["rounds"].items():
        assert r["kernels"] > 0 and r["host_reads"] == [], (name, r["host_reads"])
    ar = res["rounds"]["ar"]["by_op"]
    assert "aten::_to_copy" not in ar and "aten::copy_" not in ar, ar
    # every layer's work is there: one attention (2 launches) per layer
    assert ar["kdtree::tree_verify_mla"] == 2 * res["layers"]
    # the shared expert's down projection is the MoE op's (its combine kernel), not a GEMM of its own
    assert "aten::addmm_" not in ar and "aten::addmm" not in ar, ar
    # the drafter's block: embedding, first norm and its rope in one launch (the context's rope stays)
    dd = res["rounds"]["ddtree-4"]["by_op"]
    assert "aten::embedding" not in dd and dd["kdtree::rope_cos_sin"] == 1, dd
