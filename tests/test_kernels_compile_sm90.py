"""The decode round's newer Triton kernels compile for sm_90 on this CPU machine (Triton's own ptxas), so a
kernel that would not build fails here and not first on the GPU: the MLA absorption products, the rope tables,
the round's emission, the older rope kernel that shares their rounding (_rotate), the MoE routing kernel with
the shared expert's activation (with and without the list of active experts), the MoE combine (and with the
shared expert's down projection), the TP greedy token's two kernels, the drafter's attention, K/V store and block,
the residual norm, SiLU * up, the vocab-parallel embedding and one rank's first stage
(the layer kernels with programmatic dependent
launch, as sm_90 launches them), at the specialisations the runtime launches (bf16 K2.6 shapes at t = 1 .. 64,
the fp32 tiny models).  Each gives an ELF cubin; the rope tables' kernels must not use the approximate cos / sin."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def specialisations() -> list:
    from plugins.common.aot import TritonKernel
    from plugins.drafter_attention.kernel import _combine_kernel, _split_kernel
    from plugins.layer_fusion.kernel import (
        _add_rms_norm_kernel,
        _drafter_block_kernel,
        _embed_norm_rope_kernel,
        _embed_range_kernel,
        _kv_norm_rope_store_kernel,
        _mla_q_absorb_kernel,
        _mla_rope_kv_kernel,
        _mla_v_absorb_kernel,
        _rope_cos_sin_kernel,
        _silu_mul_kernel,
    )
    from plugins.moe_w4a16.expert_kernels import combine_kernel, combine_shared_kernel
    from plugins.moe_w4a16.route_kernel import route_kernel
    from plugins.round_emit.kernel import _round_emit_kernel
    from plugins.tree_accept.vocab_argmax_kernel import vocab_argmax_local_kernel, vocab_argmax_pick_kernel

    def kernel(name, fn, types, consts, warps):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in inspect.signature(fn.fn).parameters}
        return TritonKernel("check", name, fn, sig, consts, warps, 3)

    out = []
    for dt in ("*bf16", "*fp32"):
        ieee = dt == "*fp32"
        t = {"q_ptr": dt, "w_ptr": dt, "cos_ptr": dt, "sin_ptr": dt, "out_ptr": dt}
        for bt in (16, 64):
            c = dict(INTERLEAVE=True, IEEE=ieee, N_CB=8, BT=bt, BLOCK_P=128, BLOCK_C=64, BLOCK_R=32, EARLY=False,
                     PDL=True)
            out.append(kernel(f"q_absorb_{dt[1:]}_bt{bt}", _mla_q_absorb_kernel, t, c, 4))
        out.append(kernel(f"q_absorb_early_{dt[1:]}_bt16", _mla_q_absorb_kernel, t, c | dict(BT=16, EARLY=True), 4))
        t = {"o_ptr": dt, "w_ptr": dt, "out_ptr": dt}
        for bt, bu in ((16, 16), (64, 64)):
            c = dict(C=512, IEEE=ieee, BT=bt, BLOCK_U=bu, BLOCK_K=128, EARLY=False, PDL=True)
            out.append(kernel(f"v_absorb_{dt[1:]}_bt{bt}", _mla_v_absorb_kernel, t, c, 4))
        c = dict(C=512, IEEE=ieee, BT=16, BLOCK_U=16, BLOCK_K=512, EARLY=True, PDL=True)  # layer_fusion EARLY_WEIGHTS
        out.append(kernel(f"v_absorb_early_{dt[1:]}_bt16", _mla_v_absorb_kernel, t, c, 4))
        pos = "*i32" if dt == "*bf16" else "*i64"  # an AR step's positions are the int32 cache lengths
        t = {"pos_ptr": pos, "inv_ptr": "*fp32", "cos_ptr": dt, "sin_ptr": dt, "scale": "fp32"}
        out.append(kernel(f"rope_{dt[1:]}", _rope_cos_sin_kernel, t, dict(IEEE=True, BT=16, BLOCK_R=32, PDL=True), 1))
    t = {"lat_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
         "ql_ptr": "*bf16", "qw_ptr": "*bf16", "qo_ptr": "*bf16", "eps": "fp32"}
    out.append(kernel("rope_kv_bf16", _mla_rope_kv_kernel, t, dict(INTERLEAVE=True, BLOCK_C=512, BLOCK_R=32,
                                                                   BLOCK_Q=2048, PDL=True), 4))
    # the residual norm and the MLP activation, with PDL as launched on sm_90 (K2.6: d 7168, i 2048 / 8)
    t = {n: "*bf16" for n in ("x_ptr", "a_ptr", "b_ptr", "s_ptr", "w_ptr", "y_ptr")} | {"eps": "fp32"}
    for early in (False, True):  # and its weight row before the PDL wait (layer_fusion EARLY_WEIGHTS)
        out.append(kernel(f"add_rms_norm{'_early' * early}_bf16", _add_rms_norm_kernel, t,
                          dict(HAS_ADD=True, HAS_B=False, BLOCK=8192, EARLY=early, PDL=True), 16))
    out.append(kernel("silu_mul_bf16", _silu_mul_kernel, {"gu_ptr": "*fp32", "out_ptr": "*bf16"},
                      dict(BLOCK=256, IEEE_EXP=True, PDL=True), 1))
    t = {"tok_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    out.append(kernel("embed_range_bf16", _embed_range_kernel, t, dict(BLOCK=1024, PDL=True), 4))
    t = {"tok_ptr": "*i64", "w_ptr": "*bf16", "nw_ptr": "*bf16", "x_ptr": "*bf16", "h_ptr": "*bf16", "pos_ptr": "*i32",
         "inv_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "eps": "fp32", "scale": "fp32"}
    out.append(kernel("embed_norm_rope_bf16", _embed_norm_rope_kernel, t,
                      dict(IEEE=True, BLOCK=8192, BLOCK_R=32, PDL=True), 16))
    # the drafter (K2.6: head_dim 128, block 8, 8 q heads over 1 kv head per rank when sharded)
    t = {"kv_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
         "k_ptr": "*bf16", "v_ptr": "*bf16", "q_ptr": "*bf16", "qw_ptr": "*bf16", "qo_ptr": "*bf16", "eps": "fp32"}
    for has_q in (False, True):
        out.append(kernel(f"kv_norm_rope_store_q{int(has_q)}", _kv_norm_rope_store_kernel, t,
                          dict(INTERLEAVE=False, HAS_Q=has_q, BLOCK=64, PDL=True), 1))
    t = {"lens_ptr": "*i32", "ctx_len_ptr": "*i32", "bonus_ptr": "*i64", "ctx_pos_ptr": "*i64", "blk_pos_ptr": "*i64",
         "block_ptr": "*i64", "visible_ptr": "*i64", "mask_id": "i32"}
    out.append(kernel("drafter_block", _drafter_block_kernel, t, dict(BLOCK_A=16, BLOCK_S=8, PDL=True), 1))
    t = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "vis_ptr": "*i64", "out_ptr": "*bf16",
         "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32"}
    for direct in (False, True):
        c = dict(E=128, BLOCK_M=64, BLOCK_N=64, DIRECT=direct, IEEE=False, PDL=True)
        out.append(kernel(f"drafter_attention_split_direct{int(direct)}", _split_kernel, t, c, 8))
    out.append(kernel("drafter_attention_combine", _combine_kernel, {"o_ptr": "*fp32", "m_ptr": "*fp32",
                                                                     "l_ptr": "*fp32", "out_ptr": "*bf16"},
                      dict(E=128, BLOCK_M=64, S_PAD=32, PDL=True), 1))
    t = {"cand_ptr": "*i64", "count_ptr": "*i32", "stop_ptr": "*i64", "produced_ptr": "*i32", "max_new_ptr": "*i32",
         "live_ptr": "*i32", "nonfinite_ptr": "*i64", "out_ptr": "*i64", "bonus_ptr": "*i64", "tok_ptr": "*i64",
         "idx_ptr": "*i32", "ctx_ptr": "*i64", "lens_ptr": "*i32"}
    for ar, tree, block_a in ((True, False, 2), (False, False, 32), (False, True, 8)):  # an AR step advances lens
        out.append(kernel(f"emit_ar{int(ar)}_tree{int(tree)}", _round_emit_kernel, t,
                          dict(AR=ar, TREE=tree, LENS=ar, BLOCK_A=block_a, BLOCK_S=16, PDL=True), 1))
    # the MoE routing kernel forming the shared expert's activation (K2.6 TP8: 384 experts, top 8, i' 256)
    t = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i32", "w_ptr": "*fp32", "counts_ptr": "*i32",
         "active_ptr": "*i32", "lists_ptr": "*i32", "scaling": "fp32", "su_ptr": "*fp32", "h_ptr": "*bf16"}
    c = dict(K=8, N_GROUP=1, TOPK_GROUP=1, NORM=True, BT=1, BE=512, BKK=8, BG=2, SHARED=True, BS=256, IEEE_EXP=True,
             PDL=True)
    out.append(kernel("route_shared_bf16", route_kernel, t, c, 1))
    out.append(kernel("route_v3_bf16", route_kernel, t, c | dict(ACTIVE=False), 1))  # v3's form: no active list
    t = {"out_ptr": "*fp32", "idx_ptr": "*i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
    out.append(kernel("moe_combine_bf16", combine_kernel, t, dict(K=8, BD=1024, BC=512, PDL=True), 4))
    # ... with the shared expert's down projection (K2.6 TP8: i' 256; token tiles of 16 and 64)
    t = t | {"h_ptr": "*bf16", "w_ptr": "*bf16"}
    for bt in (16, 64):
        c = dict(K=8, BT=bt, BD=64, BI=128, N_KI=2, BC=512, DOT_PREC="tf32", PDL=True, EARLY=False, SHARED_F=False)
        out.append(kernel(f"moe_combine_shared_bf16_bt{bt}", combine_shared_kernel, t, c, 4))
    # ... with the shared product before the PDL wait (launch_v3.EARLY_WEIGHTS)
    out.append(kernel("moe_combine_shared_early_bf16_bt16", combine_shared_kernel, t, c | dict(BT=16, EARLY=True), 4))
    # ... adding the product the one-token grid formed (fp32 [t, d]: launch_v3.ONE_SHARED)
    c = dict(K=8, BT=1, BD=1024, BI=16, N_KI=1, BC=512, DOT_PREC="ieee", PDL=True, SHARED_F=True)
    out.append(kernel("moe_combine_shared_f_bf16", combine_shared_kernel, t | {"h_ptr": "*fp32"}, c, 4))
    # the TP greedy token: each rank's (max, index) pairs, then the pick across ranks
    out.append(kernel("vocab_argmax_local", vocab_argmax_local_kernel, {"x_ptr": "*fp32", "pair_ptr": "*fp64"},
                      dict(BLOCK_V=4096, PDL=True), 8))
    t = {"every_ptr": "*fp64", "ids_ptr": "*i64", "flag_ptr": "*i64"}
    out.append(kernel("vocab_argmax_pick", vocab_argmax_pick_kernel, t, dict(BLOCK_R=32, PDL=True), 1))
    # tree_build's top-k kernels (K2.6: vocab 163840, depth 7, K = B = 16), with PDL
    from plugins.tree_build.topk_kernel import (
        HIST_BINS,
        _gather_kernel,
        _lse_partial_kernel,
        _radix_pass_kernel,
        _sort_rows_kernel,
    )
    t = {"logits_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "hist_ptr": "*i32", "cnt_ptr": "*i32",
         "chunk_hist_ptr": "*i32", "cand_lp_ptr": "*fp32", "cand_id_ptr": "*i32", "lp_ptr": "*fp32", "ids_ptr": "*i32"}
    out.append(kernel("lse_partial", _lse_partial_kernel, t, dict(CH=4096, HIST_BINS=HIST_BINS, PDL=True), 8))
    out.append(kernel("radix_pass", _radix_pass_kernel, t, dict(PASS=1, CH=4096, C_PAD=64, HIST_BINS=HIST_BINS,
                                                               PDL=True), 8))
    out.append(kernel("gather", _gather_kernel, t, dict(CH=4096, C_PAD=64, HIST_BINS=HIST_BINS, PDL=True), 8))
    out.append(kernel("sort_rows", _sort_rows_kernel, t, dict(K_PAD=16, PDL=True), 4))
    from plugins.tree_verify_mla.aot import _split_kernel  # with the cache prefetch before its wait
    from plugins.tree_verify_mla.launcher import CONFIGS_16BIT
    split = _split_kernel(CONFIGS_16BIT[2][1], False)
    out.append(dataclasses.replace(split, name="tree_verify_split_prefetch_bf16",
                                   constexprs={**split.constexprs, "PREFETCH": True}))
    return out


@pytest.mark.slow
def test_round_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, __file__, "--compile", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(recs) == 43
    for r in recs:
        assert (tmp_path / r["cubin"]).read_bytes()[:4] == b"\x7fELF", r
        if "_early" in r["name"]:  # weights (the MoE combine's, layer_fusion's), then the PDL wait
            ptx = (tmp_path / r["ptx"]).read_text()
            assert -1 < ptx.find("ld.global") < ptx.find("griddepcontrol.wait"), r["name"]
        if r["name"] == "tree_verify_split_prefetch_bf16":  # the hint, and before the PDL wait
            ptx = (tmp_path / r["ptx"]).read_text()
            assert -1 < ptx.find("cp.async.bulk.prefetch.L2.global") < ptx.find("griddepcontrol.wait"), r["name"]
        if r["name"].startswith(("rope", "embed_norm_rope")):
            ptx = (tmp_path / r["ptx"]).read_text()
            assert "cos.approx" not in ptx and "sin.approx" not in ptx, r["name"]
    pdl = {k.name for k in specialisations() if k.constexprs.get("PDL")}
    assert len(pdl) >= 15
    for r in recs:  # a PDL kernel waits for its predecessor grid before anything else
        if r["name"] in pdl:
            assert "griddepcontrol.wait" in (tmp_path / r["ptx"]).read_text(), r["name"]


if __name__ == "__main__" and "--compile" in sys.argv:
    from build_pipeline.compile_kernels import compile_triton
    dest = Path(sys.argv[sys.argv.index("--compile") + 1])
    print(json.dumps([compile_triton(k, "sm_90", dest) for k in specialisations()]))
