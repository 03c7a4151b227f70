"""Per-rank ONNX graphs of each layer type, with `kdtree::` custom-op nodes for the plugins.

One graph per piece between two all-reduces, shared by every layer of that type (weights are graph
inputs, bound by name from the rank's safetensors with the `layers.{i}.` prefix dropped), so a graph
holds structure only and TensorRT or the runtime binds the stored (bf16 / packed INT4) tensors:

  embed.onnx  tokens [b, n] int64 -> x_part [b, n, d]       (vocab-parallel: rows outside the rank give 0)
  attn.onnx   x [b, n, d], cos/sin [b, n, r/2], cache [b, l, c+r], cache_lens [b] int32,
              tree_mask [b, n, w] int64 -> attn_part [b, n, d], tree_kv [b, n, c+r]
              (attn_norm, q path, absorbed W_UK, kdtree::tree_verify_mla, W_UV, o_proj on h_l heads)
  mlp.onnx    x -> mlp_part [b, n, d]                       (dense layers: mlp_norm + SwiGLU on i_l)
  moe.onnx    x -> moe_part [b, n, d]                       (mlp_norm, fp32 router, kdtree::moe_w4a16 or
                                                              kdtree::moe_w16a16 on local experts, shared expert)
  head.onnx   x -> logits_part [b, n, v_l]                  (final norm + this rank's lm_head rows)

`_part` outputs are this rank's partial sums: the runtime all-reduces them (logits: gathers) and adds
the residual.  Activations are fp32 in the graphs; stored weights are Cast on use.
Custom ops (domain "kdtree", version 1; Python implementations in onnx_ops.py):
  tree_verify_mla(q, cache, cache_lens, tree_kv, tree_mask) -> out [b, n, h_l, c], lse [b, n, h_l]
      attrs scale (float), d_v (int)
  moe_w4a16(x [t, d], logits [t, e], bias [e], w13_packed, w13_scale, w2_packed, w2_scale) -> y [t, d]
      (INT4 experts in the kernel layout of plugins/moe_w4a16/layout.py, as stored by shard.py)
  moe_w16a16(x, logits, bias, w13 [e_l, 2*i_l, d], w2 [e_l, d, i_l]) -> y
      attrs top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, expert_first, group_size
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper

from core.config import ModelConfig
from core.plan import ParallelPlan

OPSET = 17
DOMAIN = "kdtree"
F32 = TensorProto.FLOAT
_ONNX_DTYPE = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
               torch.float16: TensorProto.FLOAT16, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}


class _Graph:
    """A small builder over onnx.helper: named inputs, auto-named intermediate values."""

    def __init__(self, name: str, weights: dict[str, torch.Tensor]):
        self.name, self.weights = name, weights
        self.nodes, self.inputs, self.outputs, self.inits = [], [], [], []
        self._n = 0
        self._bound: dict[str, str] = {}  # weight name -> its fp32 value in the graph

    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def weight(self, name: str) -> str:
        """A stored weight as a graph input (its stored dtype and shape), Cast to fp32 when float."""
        if name not in self._bound:
            t = self.weights[name]
            self.raw(name)
            self._bound[name] = self.op("Cast", [name], to=F32) if t.is_floating_point() and t.dtype != torch.float32 \
                else name
        return self._bound[name]

    def raw(self, name: str) -> str:
        """A stored weight as a graph input, as stored (custom ops take packed INT4 and scales as they are)."""
        t = self.weights[name]
        return self.input(name, _ONNX_DTYPE[t.dtype], list(t.shape))

    def const(self, values, dtype=TensorProto.INT64) -> str:
        name = self._fresh("c")
        vals = values if isinstance(values, list) else [values]
        self.inits.append(helper.make_tensor(name, dtype, [len(vals)] if isinstance(values, list) else [], vals))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs):
        outs = [self._fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def output(self, value: str, name: str, elem: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=name + "_out"))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              producer_name="kdtree build")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m

    def _fresh(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    # ---- layers ----
    def linear(self, x: str, w: str) -> str:
        """x [..., in] . W[out, in]^T."""
        return self.op("MatMul", [x, self.op("Transpose", [self.weight(w)], perm=[1, 0])])

    def rms_norm(self, x: str, w: str, eps: float) -> str:
        ms = self.op("ReduceMean", [self.op("Mul", [x, x])], axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.const(eps, F32)])])])
        return self.op("Mul", [self.weight(w), self.op("Mul", [x, inv])])

    def rope(self, x: str, cos: str, sin: str, interleave: bool, r: int) -> str:
        """x [..., r] -> rotated, de-interleaved (runtime/rope.py); cos/sin broadcast to x."""
        if interleave:
            x1 = self.op("Slice", [x, self.const([0]), self.const([r]), self.const([-1]), self.const([2])])
            x2 = self.op("Slice", [x, self.const([1]), self.const([r]), self.const([-1]), self.const([2])])
        else:
            x1, x2 = self.op("Split", [x, self.const([r // 2, r // 2])], n_out=2, axis=-1)
        a = self.op("Sub", [self.op("Mul", [x1, cos]), self.op("Mul", [x2, sin])])
        b = self.op("Add", [self.op("Mul", [x2, cos]), self.op("Mul", [x1, sin])])
        return self.op("Concat", [a, b], axis=-1)

    def swiglu(self, x: str, gate_up: str, down: str) -> str:
        gate, up = self.op("Split", [self.linear(x, gate_up)], n_out=2, axis=-1)
        return self.linear(self.op("Mul", [self.op("Mul", [gate, self.op("Sigmoid", [gate])]), up]), down)


def attn_graph(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> onnx.ModelProto:
    g = _Graph("attn", w)
    d, p, r, c = cfg.hidden_size, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    h_l = w["attn.w_uk"].shape[0]
    x = g.input("x", F32, ["b", "n", d])
    cos, sin = g.input("cos", F32, ["b", "n", r // 2]), g.input("sin", F32, ["b", "n", r // 2])
    cache = g.input("cache", F32, ["b", "l", c + r])
    lens = g.input("cache_lens", TensorProto.INT32, ["b"])
    mask = g.input("tree_mask", TensorProto.INT64, ["b", "n", "w"])
    xn = g.rms_norm(x, "attn_norm", cfg.rms_norm_eps)
    if cfg.q_lora_rank is not None:
        q = g.linear(g.rms_norm(g.linear(xn, "attn.q_a"), "attn.q_a_norm", cfg.rms_norm_eps), "attn.q_b")
    else:
        q = g.linear(xn, "attn.q")
    q = g.op("Reshape", [q, g.const([0, 0, h_l, p + r])])  # [b, n, h_l, p+r]
    q_nope, q_pe = g.op("Split", [q, g.const([p, r])], n_out=2, axis=-1)
    cos_h, sin_h = g.op("Unsqueeze", [cos, g.const([2])]), g.op("Unsqueeze", [sin, g.const([2])])
    q_pe = g.rope(q_pe, cos_h, sin_h, cfg.rope_interleave, r)
    q_lat = g.op("Einsum", [q_nope, g.weight("attn.w_uk")], equation="bnhp,hpc->bnhc")  # [b, n, h_l, c]
    latent = g.linear(xn, "attn.kv_a")  # [b, n, c+r]
    c_kv, k_pe = g.op("Split", [latent, g.const([c, r])], n_out=2, axis=-1)
    tree_kv = g.op("Concat", [g.rms_norm(c_kv, "attn.kv_a_norm", cfg.rms_norm_eps),
                              g.rope(k_pe, cos, sin, cfg.rope_interleave, r)], axis=-1)  # [b, n, c+r]
    q_full = g.op("Concat", [q_lat, q_pe], axis=-1)  # [b, n, h_l, c+r]
    o_lat, _lse = g.op("tree_verify_mla", [q_full, cache, lens, tree_kv, mask], n_out=2, domain=DOMAIN,
                       scale=float(cfg.softmax_scale), d_v=c)
    o = g.op("Einsum", [o_lat, g.weight("attn.w_uv")], equation="bnhc,huc->bnhu")  # [b, n, h_l, u]
    out = g.linear(g.op("Reshape", [o, g.const([0, 0, -1])]), "attn.o")
    g.output(out, "attn_part", F32, ["b", "n", d])
    g.output(tree_kv, "tree_kv", F32, ["b", "n", c + r])
    return g.model()


def mlp_graph(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> onnx.ModelProto:
    g = _Graph("mlp", w)
    x = g.input("x", F32, ["b", "n", cfg.hidden_size])
    y = g.swiglu(g.rms_norm(x, "mlp_norm", cfg.rms_norm_eps), "mlp.gate_up", "mlp.down")
    g.output(y, "mlp_part", F32, ["b", "n", cfg.hidden_size])
    return g.model()


def moe_graph(cfg: ModelConfig, plan: ParallelPlan, rank: int, w: dict[str, torch.Tensor]) -> onnx.ModelProto:
    g = _Graph("moe", w)
    d = cfg.hidden_size
    x = g.input("x", F32, ["b", "n", d])
    xt = g.op("Reshape", [g.rms_norm(x, "mlp_norm", cfg.rms_norm_eps), g.const([-1, d])])  # [t, d]
    logits = g.op("MatMul", [xt, g.op("Transpose", [g.op("Cast", [g.raw("moe.gate")], to=F32)], perm=[1, 0])])
    bias = g.op("Cast", [g.raw("moe.gate_bias")], to=F32)
    attrs = dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                 norm_topk_prob=int(cfg.norm_topk_prob), routed_scaling_factor=float(cfg.routed_scaling_factor),
                 expert_first=plan.local_experts(cfg, rank)[0])
    if "moe.w13_packed" in w:
        names = ["moe.w13_packed", "moe.w13_scale", "moe.w2_packed", "moe.w2_scale"]
        y = g.op("moe_w4a16", [xt, logits, bias] + [g.raw(n) for n in names], domain=DOMAIN,
                 group_size=cfg.quant.group_size, **attrs)
    else:
        y = g.op("moe_w16a16", [xt, logits, bias, g.raw("moe.w13"), g.raw("moe.w2")], domain=DOMAIN, **attrs)
    if cfg.n_shared_experts:
        y = g.op("Add", [y, g.swiglu(xt, "moe.shared.gate_up", "moe.shared.down")])
    g.output(g.op("Reshape", [y, g.op("Shape", [x])]), "moe_part", F32, ["b", "n", d])
    return g.model()


def embed_graph(cfg: ModelConfig, plan: ParallelPlan, rank: int, w: dict[str, torch.Tensor]) -> onnx.ModelProto:
    g = _Graph("embed", w)
    v0, v1 = plan.vocab_range(cfg, rank)
    tokens = g.input("tokens", TensorProto.INT64, ["b", "n"])
    local = g.op("Sub", [tokens, g.const(v0)])
    inside = g.op("And", [g.op("GreaterOrEqual", [local, g.const(0)]), g.op("Less", [local, g.const(v1 - v0)])])
    rows = g.op("Gather", [g.weight("embed"), g.op("Where", [inside, local, g.const(0)])], axis=0)  # [b, n, d]
    keep = g.op("Unsqueeze", [g.op("Cast", [inside], to=F32), g.const([-1])])
    g.output(g.op("Mul", [rows, keep]), "x_part", F32, ["b", "n", cfg.hidden_size])
    return g.model()


def head_graph(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> onnx.ModelProto:
    g = _Graph("head", w)
    x = g.input("x", F32, ["b", "n", cfg.hidden_size])
    logits = g.linear(g.rms_norm(x, "norm", cfg.rms_norm_eps), "embed" if cfg.tie_word_embeddings else "lm_head")
    g.output(logits, "logits_part", F32, ["b", "n", w["embed"].shape[0]])
    return g.model()


def layer_weights(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """A layer's stored tensors with the `layers.{i}.` prefix dropped (the graphs' input names)."""
    pre = f"layers.{layer}."
    return {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}


def export_rank(cfg: ModelConfig, plan: ParallelPlan, rank: int, tensors: dict[str, torch.Tensor],
                out: Path) -> list[str]:
    """Write graphs/rank{r}/*.onnx from one rank's stored tensors (globals plus one layer of each type
    present, for shapes and dtypes); returns the relative paths."""
    rel = Path("graphs") / f"rank{rank}"
    (out / rel).mkdir(parents=True, exist_ok=True)
    graphs = {"embed": embed_graph(cfg, plan, rank, tensors), "head": head_graph(cfg, tensors)}
    first_dense = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), None)
    first_moe = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), None)
    some = first_dense if first_dense is not None else first_moe
    graphs["attn"] = attn_graph(cfg, layer_weights(tensors, some))
    if first_dense is not None:
        graphs["mlp"] = mlp_graph(cfg, layer_weights(tensors, first_dense))
    if first_moe is not None:
        graphs["moe"] = moe_graph(cfg, plan, rank, layer_weights(tensors, first_moe))
    paths = []
    for name, model in graphs.items():
        onnx.save(model, str(out / rel / f"{name}.onnx"))
        paths.append((rel / f"{name}.onnx").as_posix())
    return paths
