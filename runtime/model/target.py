"""The target model's forward pass (DeepSeek-V3 / Kimi K2.x) in plain torch, CPU and CUDA alike.

One entry point serves every mode: a prefill chunk (n prompt tokens, chain mask), an AR step
(n = 1) and a tree verification (n = 1 root + B nodes, ancestor mask).  It returns the final hidden
states and, for the drafter, the hidden states after the requested layers.

Tensor parallel (`comm` and `plan` given, core/plan.py): the weights are this rank's slice.
Attention runs the rank's h/tp heads and o_proj its columns, the MLP / shared expert / TP-sliced
experts their intermediate slice, so each block's output is a partial sum: one all-reduce after
o_proj and one after the MLP or MoE (routed + shared summed first).  The embedding and lm_head are
vocab-parallel.  Everything outside those collectives (norms, latent projections, router, residual
stream, the speculative control ops of runtime/decode/round.py) is computed redundantly on every rank from
bit-identical inputs: an all-reduce / all-gather delivers the same bytes to every rank.

Speculative control (tree_build, tree_accept, kv_commit, sampling) is therefore computed by every
rank rather than by rank 0 and broadcast: its inputs (gathered draft logits, the distributed argmax
or the gathered target logits, the same counter-based generator state of plugins/common/rng.py) are
identical on all ranks, so the results are too, and recomputing costs less than the broadcast it
replaces: gloo, 2 ranks (benchmarks/results/tp_logits_gloo.json): broadcasting a round's 5 control
tensors ~0.5-0.9 ms vs ~50 us to redo tree_accept with the CPU reference; on GPUs the kernels take
a few us while each NCCL broadcast adds a launch-bound collective and a dependency on rank 0 inside
the captured round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.config import ModelConfig
from core.plan import ParallelPlan
from plugins.common.precision import acc_dtype
from plugins.layer_fusion import add_rms_norm, embed_norm_rope, embed_range
from plugins.moe_w4a16 import MoEWorkspace, expert_dims
from plugins.tree_accept.vocab_argmax import vocab_argmax_local, vocab_argmax_pick
from runtime.model import attention
from runtime.model.attention import mla_forward
from runtime.model.cache import LatentCache
from runtime.model.layers import linear, rms_norm, swiglu_mlp
from runtime.model.moe import moe_forward
from runtime.model.rope import Rope
from runtime.model.weights import MoEWeights, TargetWeights
from runtime.model.workspace import ForwardWorkspace
from runtime.parallel.comm import Comm


class TargetModel:
    def __init__(self, cfg: ModelConfig, weights: TargetWeights, feature_layers: tuple[int, ...] = (),
                 comm: Comm | None = None, plan: ParallelPlan | None = None):
        """feature_layers: decoder-layer indices whose output hidden states forward() also returns.
        comm / plan: this rank's group and the plan its `weights` were cut with (None: one rank, whole)."""
        self.cfg, self.w = cfg, weights
        self.device, self.dtype = weights.embed.device, weights.embed.dtype
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave, self.device)
        self.feature_layers = tuple(feature_layers)
        self.comm, self.plan = comm, plan or ParallelPlan()
        world = comm.world if comm is not None else 1
        if self.plan.tp != world:
            raise ValueError(f"--tp {self.plan.tp}: the weights were cut for {self.plan.tp} ranks, "
                             f"the group has {world}")
        rank = comm.rank if comm is not None else 0
        self.vocab_start, self.vocab_end = self.plan.vocab_range(cfg, rank)
        self.experts = self.plan.local_experts(cfg, rank)  # (first, count) held whole (ep) or sliced
        _check_shapes(cfg, self.plan, weights, self.plan.vocab_rows(cfg), self.experts[1])

    def new_cache(self, batch: int, capacity: int, tokens_per_forward: int) -> LatentCache:
        """The latent cache of `batch` requests of up to `capacity` tokens, with the workspace of forwards
        of up to tokens_per_forward tokens each."""
        cfg, tokens = self.cfg, batch * tokens_per_forward
        work = ForwardWorkspace.allocate(tokens, self.plan.local_heads(cfg), cfg.kv_lora_rank, self.dtype,
                                         self.device, self._moe_workspace(tokens))
        return LatentCache.allocate(cfg.num_layers, batch, capacity, tokens_per_forward, cfg.d_qk, self.dtype,
                                    self.device, work)

    def _moe_workspace(self, tokens: int) -> torch.Tensor | None:
        """The kdtree::moe_w4a16 buffer for `tokens` tokens (every MoE layer has the same shapes); None
        without MoE layers or on CPU, where the op is the reference, which has no scratch to keep."""
        moe = next((lw.mlp for lw in self.w.layers if isinstance(lw.mlp, MoEWeights)), None)
        if moe is None or self.device.type != "cuda":
            return None
        ex = moe.experts
        return MoEWorkspace.allocate(tokens, self.cfg.num_experts_per_tok, ex.count, self.cfg.hidden_size,
                                     expert_dims(ex.w13)[1], self.dtype, self.device).buffer

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache,
                tree_mask: torch.Tensor, features: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [b, n] (positions int32 or int64); tree_mask [b, n, w].  features False: none
        returned (an AR step has no drafter to feed: no concatenation kernel).

        Returns (hidden [b, n, d] after the final norm, features [b, n, f*d] or None), where features
        concatenates the outputs of feature_layers in order.  Writes the tokens' latent rows into
        cache.scratch[:, :, :n] and uses cache.work for the ops' scratch; the committed cache is only read.
        """
        cfg = self.cfg
        feats: dict[int, torch.Tensor] = {}
        layers, eps = self.w.layers, cfg.rms_norm_eps
        first_norm = layers[0].attn_norm if layers else self.w.norm
        x, hn, cos, sin = self.embed_norm_rope(tokens, first_norm, eps, positions, self.rope)
        for li, lw in enumerate(layers):
            a = mla_forward(cfg, lw.attn, self.rope, hn, cos, sin, cache.kv[li], cache.lens, cache.scratch[li],
                            tree_mask, cache.work, self._next_gemms(lw) if attention.GEMM_PREFETCH else ())  # [b, n, d]
            x, hn = add_rms_norm(x, self._reduce(a), lw.mlp_norm, eps)  # residual, then the MLP's norm
            if isinstance(lw.mlp, MoEWeights):
                m = moe_forward(cfg, lw.mlp, hn, self.experts[0], cache.work.moe)  # ep: experts from experts[0]
            else:
                m = swiglu_mlp(hn, lw.mlp.gate_up, lw.mlp.down)
            # routed + shared (or dense) partial sums, one all-reduce; the next layer's norm (the final one last)
            nxt = layers[li + 1].attn_norm if li + 1 < len(layers) else self.w.norm
            x, hn = add_rms_norm(x, self._reduce(m), nxt, eps)  # [b, n, d] each
            if features and li in self.feature_layers:
                feats[li] = x
        hidden = hn
        features = torch.cat([feats[i] for i in self.feature_layers], dim=-1) if feats else None
        return hidden, features

    @staticmethod
    def _next_gemms(lw) -> tuple[torch.Tensor | None, ...]:
        """The weights of a layer's GEMMs after its attention's o_proj: the router (with the shared expert's gate_up
        when stacked) and the shared expert's down, or the dense MLP's (what mla_forward may prefetch)."""
        if isinstance(lw.mlp, MoEWeights):
            joint = lw.mlp.router_inputs()
            return (joint if joint is not None else lw.mlp.gate, lw.mlp.shared.down if lw.mlp.shared else None)
        return (lw.mlp.gate_up, lw.mlp.down)

    def embed_norm_rope(self, tokens: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                        rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions [b, n] -> (x = embed(tokens), rms_norm(x) * norm_weight [b, n, d], and rope's cos, sin
        [b, n, r/2] in x's dtype): a forward's first stage (the target's, the drafter's block).  With no all-reduce
        after the embedding (no TP group, or a group of one) the four come from one launch."""
        if self.comm is None or self.comm.world == 1:
            return embed_norm_rope(tokens, self.w.embed, self.vocab_start, self.vocab_end - self.vocab_start,
                                   norm_weight, eps, positions, rope.inv_freq, rope.scale)
        x = self.embed(tokens)  # [b, n, d]
        cos, sin = rope.cos_sin(positions, x.dtype)  # [b, n, r/2] each
        return x, rms_norm(x, norm_weight, eps), cos, sin

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, n] int64 -> [b, n, d].  Vocab-parallel under TP: each rank looks up the ids in its
        range [vocab_start, vocab_end), zeros the others, and the all-reduce sums the one non-zero row."""
        if self.comm is None:
            return F.embedding(tokens, self.w.embed)
        x = embed_range(tokens, self.w.embed, self.vocab_start, self.vocab_end - self.vocab_start)  # [b, n, d]
        return self.comm.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., v] (fp32, or fp64 for an fp64 model), the full vocabulary on
        every rank (all-gather of the vocab-parallel pieces under TP)."""
        local = self._local_logits(hidden)  # [..., v_l]
        if self.comm is None:
            return local
        return self.comm.all_gather(local, dim=-1)[..., :self.cfg.vocab_size].contiguous()  # [..., v]: padding cut

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> this rank's vocabulary rows' logits [..., v_l], straight from the fp32 accumulator."""
        return linear(hidden, self.w.lm_head, out_dtype=acc_dtype(hidden.dtype))

    def greedy(self, hidden: torch.Tensor, nonfinite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [b, ...rest, d] -> (argmax token ids [b, ...rest] int64, equal to logits(hidden).argmax(-1);
        nonfinite [b] int64: 1 where a row of request b had a NaN or Inf as its best logit, which the round's
        non-finite guard reads; written into the given [b] tensor, e.g. the round's own flag, else a new one).

        Distributed argmax under TP: each rank reduces its vocab slice to (max, first index of it),
        the ranks gather those pairs (2 numbers per token instead of v/tp logits) and take the best,
        ties to the lowest id as torch.argmax does: the two launches of plugins/tree_accept/vocab_argmax.py.
        Chosen for T = 0 over gathering the logits
        (benchmarks/tp_logits.py; gloo, 2 ranks, v = 163840: n = 17 tokens 3.1 ms vs 22.6 ms for the
        gather, n = 65 23 ms vs 283 ms; the gather moves n*v*4 bytes to every rank, this 16 n per rank)."""
        b, rest = hidden.shape[0], hidden.shape[1:-1]
        if nonfinite is None:
            nonfinite = torch.empty(b, dtype=torch.int64, device=hidden.device)  # [b]
        if self.comm is None:
            logits = self.logits(hidden)  # [..., v]
            nonfinite.copy_((~torch.isfinite(logits.amax(dim=-1))).view(b, -1).any(1))
            return logits.argmax(dim=-1), nonfinite
        local = self._local_logits(hidden)  # [..., v_l]
        rows = local.reshape(-1, local.shape[-1])  # [R, v_l]
        pair = torch.empty(rows.shape[0], 2, dtype=torch.float64, device=rows.device)  # [R, 2] exact in fp64
        # padding rows of the vocabulary (core/plan.py) past vocab_end never win
        vocab_argmax_local(rows, self.vocab_end - self.vocab_start, self.vocab_start, pair)
        every = self.comm.all_gather(pair[None], dim=0)  # [world, R, 2]
        ids = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)  # [R]
        vocab_argmax_pick(every, ids, nonfinite)
        return ids.view(b, *rest), nonfinite

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.comm is None else self.comm.all_reduce(partial)


def _check_shapes(cfg: ModelConfig, plan: ParallelPlan, w: TargetWeights, vocab_local: int, experts: int) -> None:
    """The weights are this rank's cut of `plan` (catches a plan / weights mismatch at load time)."""
    if w.embed.shape[0] != vocab_local or w.lm_head.shape[0] != vocab_local:
        raise ValueError(f"{plan.flag()}: embed / lm_head have {w.embed.shape[0]} / {w.lm_head.shape[0]} rows, "
                         f"this rank holds {vocab_local} of the vocabulary")
    heads = plan.local_heads(cfg)
    for li, lw in enumerate(w.layers):
        if lw.attn.w_uk.shape[0] != heads:
            raise ValueError(f"{plan.flag()}: layer {li} attention has {lw.attn.w_uk.shape[0]} heads, "
                             f"expected {heads} per rank")
        if isinstance(lw.mlp, MoEWeights) and lw.mlp.experts.count != experts:
            raise ValueError(f"{plan.flag()}: layer {li} holds {lw.mlp.experts.count} routed experts, "
                             f"expected {experts} per rank")

