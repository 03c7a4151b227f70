"""The parallel plan: how each weight is cut across `tp` ranks (tensor parallel, optionally expert parallel).

Rules (keys are core.weight_map keys, e.g. "layers.3.attn.q_b"):
- replicated on every rank: norms, attn.q_a / q_a_norm / kv_a / kv_a_norm (the latent projections are
  small and every rank needs the whole latent), moe.gate / moe.gate_bias (routing is computed
  identically on every rank);
- split by heads (h/tp contiguous heads per rank, head-major rows): attn.q_b (or attn.q) and attn.kv_b
  on dim 0, attn.o on dim 1 (its input columns are the heads' values);
- dense MLP, shared expert and, by default, routed experts: gate/up split on dim 0 (intermediate rows),
  down on dim 1 (intermediate columns): each rank's output is a partial sum, all-reduced;
- with `ep`: routed experts whole, expert j on rank j // (e/tp) (rule kind "experts");
- embed and lm_head: vocab-parallel, rows [rank*v_l, (rank+1)*v_l) on dim 0 with v_l = ceil(v/tp); when tp
  does not divide v the last rank's rows past v are zero padding (vLLM's padded vocab-parallel
  embedding): never looked up, cut from the gathered logits, masked from the distributed argmax.

INT4 routed experts TP-sliced: the down projection's input dim is cut, so each rank's slice must hold
whole scale groups: (moe_intermediate_size / tp) % group_size == 0 (and the packed words: % 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from core.config import ModelConfig
from core.errors import ConfigError


@dataclass(frozen=True)
class ShardRule:
    """kind: "replicate" (whole on every rank), "split" (dim cut into tp equal contiguous pieces),
    "experts" (routed expert kept whole by the rank that owns it, see ParallelPlan.local_experts)."""

    kind: str
    dim: int = 0


REPLICATE = ShardRule("replicate")
SPLIT0 = ShardRule("split", 0)
SPLIT1 = ShardRule("split", 1)
EXPERTS = ShardRule("experts", 0)

_EXPERT_KEY = re.compile(r"^layers\.\d+\.moe\.experts\.(\d+)\.(gate|up|down)$")


@dataclass(frozen=True)
class ParallelPlan:
    """tp ranks; ep: routed experts whole on ranks (expert parallel) instead of TP-sliced."""

    tp: int = 1
    ep: bool = False

    # ---- checks ----
    def flag(self) -> str:
        """The command-line spelling of this plan, for error messages: "--tp 4" or "--tp 4 --ep"."""
        return f"--tp {self.tp}" + (" --ep" if self.ep else "")

    def validate(self, cfg: ModelConfig) -> None:
        """Raise ConfigError naming the config key and the flag when `cfg` cannot be cut this way."""
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer, got {self.tp!r}")
        tp, flag = self.tp, self.flag()

        def need(key: str, value: int, div: int, why: str = "") -> None:
            if value % div:
                raise ConfigError(f"{flag}: {key} {value} is not divisible by {div}{why}")

        need("num_attention_heads", cfg.num_heads, tp)
        if cfg.first_k_dense_replace > 0:
            need("intermediate_size", cfg.intermediate_size, tp, " (dense MLP layers)")
        if cfg.first_k_dense_replace < cfg.num_layers:  # some MoE layers
            if self.ep:
                need("n_routed_experts", cfg.n_routed_experts, tp, " (expert parallel: whole experts per rank)")
            else:
                need("moe_intermediate_size", cfg.moe_intermediate_size, tp, " (routed experts TP-sliced; "
                     "or pass --ep)")
                if cfg.quant is not None and cfg.quant.kind == "int4" and tp > 1:
                    g = cfg.quant.group_size
                    per_rank = cfg.moe_intermediate_size // tp
                    if per_rank % g or per_rank % 8:
                        raise ConfigError(
                            f"{flag}: moe_intermediate_size {cfg.moe_intermediate_size} / {tp} = {per_rank} is not a "
                            f"multiple of the INT4 quantization_config group_size {g} (TP-sliced INT4 experts need "
                            f"whole scale groups per rank; pass --ep or a smaller --tp)")
            if cfg.n_shared_experts:
                need("moe_intermediate_size * n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts,
                     tp, " (shared expert)")
        # FP8 checkpoints are dequantised at load, so their block scales put no constraint here.

    # ---- rules ----
    def rule(self, key: str) -> ShardRule:
        """How the tensor named `key` (a weight_map key: the checkpoint's per-expert names) is cut."""
        if key in ("embed", "lm_head"):
            return SPLIT0
        if key == "norm" or key.endswith(("attn_norm", "mlp_norm", "attn.q_a", "attn.q_a_norm", "attn.kv_a",
                                          "attn.kv_a_norm", "moe.gate", "moe.gate_bias")):
            return REPLICATE
        if key.endswith(("attn.q_b", "attn.q", "attn.kv_b")):
            return SPLIT0
        if key.endswith("attn.o"):
            return SPLIT1
        if _EXPERT_KEY.match(key):
            if self.ep:
                return EXPERTS
            return SPLIT1 if key.endswith("down") else SPLIT0
        if key.endswith((".gate", ".up")) and (".mlp." in key or ".moe.shared." in key):
            return SPLIT0
        if key.endswith(".down") and (".mlp." in key or ".moe.shared." in key):
            return SPLIT1
        raise KeyError(f"parallel plan: no rule for weight {key!r}")

    def shard(self, key: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's piece of `tensor` (a fresh contiguous tensor for splits; the tensor itself when
        replicated).  "experts" rule: the expert's tensor comes back whole (keep it only on the rank
        in local_experts: `holds`)."""
        self._check_rank(rank)
        rule = self.rule(key)
        if rule.kind in ("replicate", "experts") or (self.tp == 1 and rule.kind == "split"):
            return tensor
        if key in ("embed", "lm_head") and tensor.shape[0] % self.tp:  # zero rows up to tp * v_l
            pad = self.tp * -(-tensor.shape[0] // self.tp) - tensor.shape[0]
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        return _split(key, tensor, rule.dim, self.tp, rank)

    # ---- per-rank ranges ----
    def local_experts(self, cfg: ModelConfig, rank: int) -> tuple[int, int]:
        """(first expert, count) whose weights rank holds: a contiguous block with ep, else all (sliced)."""
        self._check_rank(rank)
        if not self.ep:
            return 0, cfg.n_routed_experts
        per = cfg.n_routed_experts // self.tp
        return rank * per, per

    def expert_owner(self, cfg: ModelConfig, expert: int) -> int | None:
        """The rank holding routed expert `expert` whole (ep), or None when every rank holds a slice."""
        return expert // (cfg.n_routed_experts // self.tp) if self.ep else None

    def holds(self, cfg: ModelConfig, key: str, rank: int) -> bool:
        """Whether rank keeps (a piece of) tensor `key`: False only for other ranks' experts under ep."""
        m = _EXPERT_KEY.match(key)
        if not (self.ep and m):
            return True
        first, count = self.local_experts(cfg, rank)
        return first <= int(m.group(1)) < first + count

    def local_heads(self, cfg: ModelConfig) -> int:
        """Attention heads per rank."""
        return cfg.num_heads // self.tp

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """v_l: the rows of embed and lm_head each rank stores, ceil(v / tp) (padding included)."""
        return -(-cfg.vocab_size // self.tp)

    def vocab_range(self, cfg: ModelConfig, rank: int) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows rank holds of embed and lm_head (half-open; fewer than
        vocab_rows on the last rank when tp does not divide v)."""
        self._check_rank(rank)
        per = self.vocab_rows(cfg)
        return min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size)

    # ---- (de)serialisation for manifests ----
    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "ep": self.ep}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ParallelPlan":
        return cls(tp=int(d.get("tp", 1)), ep=bool(d.get("ep", False)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside [0, {self.tp}) for {self.flag()}")


def _split(key: str, tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % tp:
        raise ValueError(f"parallel plan: {key} dim {dim} of shape {list(tensor.shape)} is not divisible by tp {tp}")
    per = size // tp
    return tensor.narrow(dim, rank * per, per).contiguous()
