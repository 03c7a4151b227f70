"""Model configuration: one frozen dataclass parsed once from a checkpoint's config.json.

Dialects served (DESIGN.md "Model facts"):
- `deepseek_v3` as written by transformers >= 5 (`rope_parameters`, `num_mtp_layers`) or 4.x;
- `kimi_k2` as written by Moonshot (`rope_theta` + `rope_scaling` {type: yarn, ...}, `topk_method`,
  `scoring_func`, `num_nextn_predict_layers`, an `auto_map` that is never followed);
- `kimi_k25` (multimodal): the text model sits in `text_config`, its tensors are prefixed
  `language_model.`; the vision tower is skipped with a logged note.

Anything else is refused with a ConfigError that names the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from core.errors import ConfigError

log = logging.getLogger("kdtree.config")

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")
TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' semantics for `default` and `yarn`)."""

    kind: str  # "default" | "yarn"
    theta: float
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin tables (YaRN attention factor); 1.0 for default rope."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantConfig:
    """How quantised weights are stored. kind: "int4" (compressed-tensors pack-quantized) or "fp8"."""

    kind: str
    group_size: int = 0  # int4: values per scale along the input dim
    block: tuple[int, int] = (0, 0)  # fp8: (rows, cols) per weight_scale_inv entry


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """The text model's hyper-parameters, validated once at construction."""

    model_type: str  # dialect of the config.json it came from
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one routed expert
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from hidden
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    num_mtp_layers: int = 0  # present in the checkpoint, never run
    tensor_prefix: str = ""  # "language_model." for kimi_k25
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_layers",
                     "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: `{_KEY_OF.get(name, name)}` must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"config.json: `q_lora_rank` must be null or positive, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: `qk_rope_head_dim` must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"config.json: `n_group` ({self.n_group}) must divide `n_routed_experts` "
                              f"({self.n_routed_experts})")
        if self.topk_group > self.n_group:
            raise ConfigError(f"config.json: `topk_group` ({self.topk_group}) exceeds `n_group` ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"config.json: `num_experts_per_tok` ({self.num_experts_per_tok}) exceeds the experts "
                              f"of the `topk_group` groups it may choose from")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("config.json: `n_group` leaves fewer than 2 experts per group "
                              "(group score is a top-2 sum)")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ConfigError(f"config.json: `first_k_dense_replace` must lie in [0, num_hidden_layers], "
                              f"got {self.first_k_dense_replace}")
        if self.n_shared_experts < 0:
            raise ConfigError(f"config.json: `n_shared_experts` must be >= 0, got {self.n_shared_experts}")
        if self.rope.kind not in ("default", "yarn"):
            raise ConfigError(f"config.json: rope type {self.rope.kind!r} is not served (only default and yarn)")
        if not self.rms_norm_eps > 0 or not math.isfinite(self.rms_norm_eps):  # NaN fails `> 0`
            raise ConfigError(f"config.json: `rms_norm_eps` must be a positive number, got {self.rms_norm_eps!r}")

    # ---- derived sizes (shape vocabulary: d_c = kv_lora_rank, d_r = rope dims, d_qk = d_c + d_r) ----
    @property
    def d_qk(self) -> int:
        """Width of one latent cache row and of an absorbed query: c_kv | k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        """Width of the values read from the latent cache (the c_kv part)."""
        return self.kv_lora_rank

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times the YaRN mscale(factor, mscale_all_dim)^2."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = _yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of to_dict (used for build manifests)."""
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        if d.get("quant") is not None:
            q = dict(d["quant"])
            q["block"] = tuple(q.get("block", (0, 0)))
            d["quant"] = QuantConfig(**q)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


# checkpoint key for a dataclass field, for error messages
_KEY_OF = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Parse a config dict of any served dialect into ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{source}: `model_type` {model_type!r} is not served "
                          f"(served: {', '.join(SUPPORTED_MODEL_TYPES)})")
    prefix = ""
    text = raw
    if model_type == "kimi_k25":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: `text_config` must be an object for model_type kimi_k25")
        if text.get("model_type", "deepseek_v3") not in TEXT_MODEL_TYPES:
            raise ConfigError(f"{source}: `text_config.model_type` {text.get('model_type')!r} is not served")
        if "vision_config" in raw:
            log.info("%s: kimi_k25 vision tower present; skipped (text-only stack)", source)
        prefix = "language_model."
    where = "text_config." if prefix else ""

    def get(key: str, default: Any = _MISSING) -> Any:
        if key in text:
            return text[key]
        if default is _MISSING:
            raise ConfigError(f"{source}: required key `{where}{key}` is missing")
        return default

    def require(key: str, allowed: tuple, default: Any) -> Any:
        value = get(key, default)
        if value not in allowed:
            raise ConfigError(f"{source}: `{where}{key}` = {value!r} is not served (served: {allowed})")
        return value

    require("hidden_act", ("silu",), "silu")
    require("scoring_func", ("sigmoid",), "sigmoid")
    require("topk_method", ("noaux_tc",), "noaux_tc")
    require("moe_layer_freq", (1,), 1)
    require("attention_bias", (False,), False)
    require("pretraining_tp", (1, None), 1)

    eos = get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    quant_raw = text.get("quantization_config", raw.get("quantization_config"))

    return ModelConfig(
        model_type=model_type,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        moe_intermediate_size=get("moe_intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_heads=get("num_attention_heads"),
        q_lora_rank=get("q_lora_rank", None),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        n_routed_experts=get("n_routed_experts"),
        n_shared_experts=get("n_shared_experts", 1),
        num_experts_per_tok=get("num_experts_per_tok"),
        n_group=get("n_group", 1) or 1,
        topk_group=get("topk_group", 1) or 1,
        first_k_dense_replace=get("first_k_dense_replace", 0),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=get("max_position_embeddings"),
        rope=_parse_rope(text, source, where),
        rope_interleave=bool(get("rope_interleave", True)),
        tie_word_embeddings=bool(get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        bos_token_id=get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=eos_ids,
        pad_token_id=get("pad_token_id", raw.get("pad_token_id")),
        num_mtp_layers=int(get("num_nextn_predict_layers", get("num_mtp_layers", 0)) or 0),
        tensor_prefix=prefix,
        quant=_parse_quant(quant_raw, source) if quant_raw else None,
    )


class _Missing:
    pass


_MISSING = _Missing()


def _parse_rope(text: dict[str, Any], source: str, where: str) -> RopeConfig:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: `{where}rope_scaling` must be an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: required key `{where}rope_theta` is missing")
    if kind == "default":
        return RopeConfig(kind="default", theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"{source}: `{where}rope_scaling.type` = {kind!r} is not served (served: default, yarn)")
    max_pos = text.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings", text.get("original_max_position_embeddings", max_pos))
    if not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{source}: `{where}rope_scaling.original_max_position_embeddings` "
                          "must be a positive integer")
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original
    if factor <= 0:
        raise ConfigError(f"{source}: `{where}rope_scaling.factor` must be positive, got {factor}")
    return RopeConfig(
        kind="yarn",
        theta=float(theta),
        factor=float(factor),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _parse_quant(q: dict[str, Any], source: str) -> QuantConfig:
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: `quantization_config` must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{source}: `quantization_config.fmt` = {fmt!r} is not served (only e4m3)")
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
            raise ConfigError(f"{source}: `quantization_config.weight_block_size` must be [rows, cols], got {block!r}")
        return QuantConfig(kind="fp8", block=(block[0], block[1]))
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise ConfigError(f"{source}: `quantization_config.format` = {fmt!r} is not served (only pack-quantized)")
        groups = q.get("config_groups") or {}
        sizes = set()
        for name, group in groups.items():
            w = (group or {}).get("weights") or {}
            key = f"quantization_config.config_groups.{name}.weights"
            if w.get("num_bits") != 4 or w.get("type", "int") != "int":
                raise ConfigError(f"{source}: `{key}` must be 4-bit int, got num_bits={w.get('num_bits')!r} "
                                  f"type={w.get('type')!r}")
            if not w.get("symmetric", False):
                raise ConfigError(f"{source}: `{key}.symmetric` must be true (asymmetric INT4 is not served)")
            if w.get("strategy") not in ("group", "channel") or not isinstance(w.get("group_size"), int):
                raise ConfigError(f"{source}: `{key}.strategy` must be group with an integer group_size")
            if w.get("actorder") not in (None, False):
                raise ConfigError(f"{source}: `{key}.actorder` = {w.get('actorder')!r} is not served")
            sizes.add(w["group_size"])
        if len(sizes) != 1:
            raise ConfigError(f"{source}: `quantization_config.config_groups` must give one group_size, "
                              f"got {sorted(sizes)}")
        (size,) = sizes
        if size <= 0 or size % 8:
            raise ConfigError(f"{source}: `quantization_config` group_size must be a positive multiple of 8, "
                              f"got {size}")
        return QuantConfig(kind="int4", group_size=size)
    raise ConfigError(f"{source}: `quantization_config.quant_method` = {method!r} is not served "
                      f"(served: compressed-tensors pack-quantized, fp8)")
