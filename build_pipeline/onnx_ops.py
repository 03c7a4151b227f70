"""Python implementations of the `kdtree::` ONNX custom ops, and a CPU runner for the exported graphs.

The graphs run in onnx's ReferenceEvaluator with these OpRun classes standing in for the plugins;
each class calls the plugin's torch reference (plugins/*/reference.py), so a graph checked here
is checked against the same oracle the kernels are.  Tensors cross as numpy (bf16 through ml_dtypes).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from plugins.moe_w4a16 import dequantize_experts
from plugins.moe_w4a16.reference import experts_reference, route_reference
from plugins.tree_verify_mla.reference import tree_verify_mla_reference


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class TreeVerifyMla(OpRun):
    op_domain = "kdtree"

    def _run(self, q, cache, cache_lens, tree_kv, tree_mask, scale=None, d_v=None):
        q_t = to_torch(q)
        b, n, h, _ = q_t.shape
        out = torch.empty(b, n, h, d_v, dtype=q_t.dtype)
        lse = torch.empty(b, n, h, dtype=torch.float32)
        tree_verify_mla_reference(q_t, to_torch(cache), to_torch(cache_lens), to_torch(tree_kv), to_torch(tree_mask),
                                  float(scale), out, lse)
        return out.numpy(), lse.numpy()


def _experts(x, logits, bias, w13, w2, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
             expert_first) -> np.ndarray:
    """Route over all e experts; sum the contributions of the experts this rank holds (ep: a block of
    them starting at expert_first; TP: all, each sliced), as plugins/moe_w4a16's reference does."""
    x_t = to_torch(x)
    idx, wt = route_reference(to_torch(logits), to_torch(bias), top_k, n_group, topk_group, bool(norm_topk_prob),
                              float(routed_scaling_factor))  # [t, k] global expert ids, fp32 weights
    return experts_reference(x_t, idx, wt, w13.to(x_t.dtype), w2.to(x_t.dtype), e_start=int(expert_first)).numpy()


class MoeW4a16(OpRun):
    op_domain = "kdtree"

    def _run(self, x, logits, bias, w13_packed, w13_scale, w2_packed, w2_scale, top_k=None, n_group=None,
             topk_group=None, norm_topk_prob=None, routed_scaling_factor=None, expert_first=None, group_size=None):
        # a kernel layout (planar or fragment order, plugins/moe_w4a16): true k is d for w13 and i_l for w2
        w13, w2 = dequantize_experts(to_torch(w13_packed), to_torch(w13_scale), to_torch(w2_packed),
                                     to_torch(w2_scale), x.shape[-1])  # fp32 [e_l, 2i_l, d], [e_l, d, i_l]
        return (_experts(x, logits, bias, w13, w2, top_k, n_group, topk_group, norm_topk_prob,
                         routed_scaling_factor, expert_first),)


class MoeW16a16(OpRun):
    op_domain = "kdtree"

    def _run(self, x, logits, bias, w13, w2, top_k=None, n_group=None, topk_group=None, norm_topk_prob=None,
             routed_scaling_factor=None, expert_first=None):
        return (_experts(x, logits, bias, to_torch(w13), to_torch(w2), top_k, n_group, topk_group, norm_topk_prob,
                         routed_scaling_factor, expert_first),)


TreeVerifyMla.__name__ = "tree_verify_mla"
MoeW4a16.__name__ = "moe_w4a16"
MoeW16a16.__name__ = "moe_w16a16"
CUSTOM_OPS = [TreeVerifyMla, MoeW4a16, MoeW16a16]


class GraphRunner:
    """Execute one exported graph on the CPU: `run(feeds) -> {output name: torch tensor}`."""

    def __init__(self, path: str | Path):
        self.sess = ReferenceEvaluator(str(path), new_ops=CUSTOM_OPS)
        self.input_names = list(self.sess.input_names)

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"graph inputs not fed: {missing}")
        outs = self.sess.run(None, {n: to_numpy(feeds[n]) for n in self.input_names})
        return {name: to_torch(np.asarray(o)) for name, o in zip(self.sess.output_names, outs)}


class OrtRunner:
    """The same interface on onnxruntime's CPU provider, for graphs without kdtree:: nodes (ORT has no
    Python custom ops without onnxruntime-extensions): a second, stricter executor of the standard ops."""

    def __init__(self, path: str | Path):
        import onnxruntime as ort

        self.ort = ort
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.sess.get_inputs()]

    def _value(self, t: torch.Tensor):
        if t.dtype == torch.bfloat16:  # ORT's numpy bridge has no bf16: hand over the bits with the ONNX type
            bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, 16)
        return self.ort.OrtValue.ortvalue_from_numpy(t.contiguous().numpy())

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outs = self.sess.run_with_ort_values(None, {n: self._value(feeds[n]) for n in self.input_names})
        return {o.name: torch.from_numpy(v.numpy()) for o, v in zip(self.sess.get_outputs(), outs)}
