"""The demo recipe: model sizes and optimisation settings in one frozen dataclass.

`DEMO` is the shipped pair (the numbers in scripts/train_demo.py's docstring); `TINY` is the same
architecture at toy size for the tests.  Sizes are checked against the issue's budgets before any
training: target <= 25 MB (INT4 routed experts with bf16 group scales, all else bf16), drafter <= 7 MB
(bf16; embedding and lm_head are the target's).
"""

from __future__ import annotations

import dataclasses
import math

INT4_GROUP = 32
TARGET_BUDGET = 25_000_000
DRAFTER_BUDGET = 7_000_000


@dataclasses.dataclass(frozen=True)
class Recipe:
    # tokenizer / target (Kimi K2 layout: MLA with q_lora + YaRN, first layer dense, MoE + shared expert)
    vocab: int = 8192
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    q_lora: int = 128
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 32
    v_head: int = 32
    dense_inter: int = 768
    experts: int = 16
    top_k: int = 4
    moe_inter: int = 256
    routed_scale: float = 2.827
    yarn_factor: float = 8.0
    yarn_original: int = 512
    # drafter (Qwen3-style layers, z-lab's DFlash format)
    d_layers: int = 3
    d_heads: int = 4
    d_kv_heads: int = 2
    d_head_dim: int = 64
    d_inter: int = 768
    block: int = 8
    taps: int = 3
    anchors: int = 32  # anchor blocks per training sequence
    # optimisation (AdamW, linear warm-up then cosine to 10 %)
    seq_len: int = 512
    batch: int = 32
    lr: float = 3e-3
    d_lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    bias_update: float = 1e-3  # aux-loss-free balancing: e_score_correction_bias step per update

    def __post_init__(self) -> None:
        if self.hidden % INT4_GROUP or self.moe_inter % INT4_GROUP:
            raise ValueError(f"hidden ({self.hidden}) and moe_inter ({self.moe_inter}) must be multiples of "
                             f"the INT4 group {INT4_GROUP}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, experts={self.experts}]")
        if self.layers < 3:
            raise ValueError(f"layers must be >= 3 (a dense first layer, MoE layers, drafter taps), got {self.layers}")
        if self.anchors * self.block > self.seq_len:
            raise ValueError(f"anchors x block ({self.anchors} x {self.block}) exceeds seq_len {self.seq_len}")

    def with_(self, **kw) -> Recipe:
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})

    # ---- sizes on disk
    def target_bytes(self) -> int:
        d, h = self.hidden, self.heads
        attn = (d * self.q_lora + self.q_lora + self.q_lora * h * (self.qk_nope + self.qk_rope)
                + d * (self.kv_lora + self.qk_rope) + self.kv_lora + self.kv_lora * h * (self.qk_nope + self.v_head)
                + h * self.v_head * d + 2 * d)
        dense = 3 * d * self.dense_inter
        routed = self.experts * 3 * d * self.moe_inter  # INT4: 4 bits + a bf16 scale per 32
        moe_bf16 = 3 * d * self.moe_inter + self.experts * d  # shared expert, gate (e_score bias fp32 below)
        bf16 = 2 * self.vocab * d + d + self.layers * attn + dense + (self.layers - 1) * moe_bf16
        int4 = (self.layers - 1) * routed
        return 2 * bf16 + int4 // 2 + 2 * int4 // INT4_GROUP + 4 * (self.layers - 1) * self.experts

    def drafter_bytes(self) -> int:
        d, e = self.hidden, self.d_head_dim
        layer = (d * e * (2 * self.d_heads + 2 * self.d_kv_heads) + 3 * d * self.d_inter + 2 * d + 2 * e)
        return 2 * (self.taps * d * d + d + self.d_layers * layer + d)

    def check_budget(self) -> None:
        t, dr = self.target_bytes(), self.drafter_bytes()
        if t > TARGET_BUDGET or dr > DRAFTER_BUDGET:
            raise ValueError(f"over budget: target {t / 1e6:.1f} MB (<= {TARGET_BUDGET / 1e6:.0f}), "
                             f"drafter {dr / 1e6:.1f} MB (<= {DRAFTER_BUDGET / 1e6:.0f})")

    def pos_weights(self) -> list[float]:
        """DFlash's loss weight of block slot t = 1..block-1: exp(-(t-1)/gamma), gamma 7 / 5 / 4 for
        block 16 / 10 / 8 as in the DFlash paper (earlier slots matter more: a miss ends the walk)."""
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block, self.block / 2)
        return [math.exp(-(t - 1) / gamma) for t in range(1, self.block)]


DEMO = Recipe()
# the tests' toy: same architecture, tiny sizes (seconds per dozen steps on a CPU)
TINY = Recipe(vocab=1024, hidden=64, layers=3, heads=2, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=16, v_head=16,
              dense_inter=128, experts=4, top_k=2, moe_inter=64, d_layers=1, d_heads=2, d_kv_heads=1, d_head_dim=32,
              d_inter=128, taps=2, anchors=4, seq_len=64, batch=4, warmup=2, lr=1e-2, d_lr=1e-2)
