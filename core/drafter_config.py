"""DFlash drafter configuration (z-lab's format): Qwen3 geometry plus `dflash_config`.

`mask_token_id`, `target_layer_ids` and `block_size` are read from `dflash_config` first, then from
the top level (older checkpoints); block_size defaults to 16.  Layer id j taps the target's
residual stream after decoder layer j (transformers' hidden_states[j + 1]).  Attention is full and
non-causal; sliding-window or causal drafters are refused naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from core.config import ModelConfig, RopeConfig, _parse_rope
from core.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class DrafterConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    vocab_size: int
    rope: RopeConfig
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    target_fingerprint: str | None = None  # dflash_config.target_fingerprint (ours; core/fingerprint.py)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers",
                     "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"drafter config.json: `{name}` must be a positive integer, "
                                  f"got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"drafter config.json: `num_key_value_heads` ({self.num_kv_heads}) must divide "
                              f"`num_attention_heads` ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"drafter config.json: `head_dim` must be even, got {self.head_dim}")
        if self.block_size < 2:
            raise ConfigError(f"drafter config.json: `block_size` must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("drafter config.json: `dflash_config.target_layer_ids` is empty")
        if not self.rms_norm_eps > 0 or not math.isfinite(self.rms_norm_eps):  # NaN fails `> 0`
            raise ConfigError(f"drafter config.json: `rms_norm_eps` must be a positive number, "
                              f"got {self.rms_norm_eps!r}")

    @property
    def depth(self) -> int:
        """Draft positions per round (block slots after the bonus)."""
        return self.block_size - 1

    def check_target(self, target: ModelConfig, target_hidden: int | None = None) -> None:
        """The drafter fits this target: same vocabulary, tapped layers exist, mask token in range."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter `vocab_size` {self.vocab_size} != target vocab_size {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"drafter `target_layer_ids` {bad} outside the target's {target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"drafter `mask_token_id` {self.mask_token_id} outside the vocabulary")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_drafter_config(drafter_dir: str | Path) -> DrafterConfig:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a drafter directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    return parse_drafter_config(raw, str(path))


def parse_drafter_config(raw: dict[str, Any], source: str = "drafter config.json") -> DrafterConfig:
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ConfigError(f"{source}: `dflash_config` must be an object")

    def get(key: str, default: Any = None, nested: bool = False) -> Any:
        if nested and key in dflash:
            return dflash[key]
        if key in raw:
            return raw[key]
        if default is None:
            where = "dflash_config." if nested else ""
            raise ConfigError(f"{source}: required key `{where}{key}` is missing")
        return default

    if raw.get("is_causal"):
        raise ConfigError(f"{source}: `is_causal` = true is not served (DFlash drafters attend non-causally)")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{source}: `layer_types` {sorted(set(layer_types))} is not served (only full_attention)")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: `attention_bias` = true is not served")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: `hidden_act` = {raw.get('hidden_act')!r} is not served (only silu)")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    ids = get("target_layer_ids", nested=True)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"{source}: `dflash_config.target_layer_ids` must be a list of integers, got {ids!r}")
    return DrafterConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads", heads),
        head_dim=get("head_dim", hidden // heads),
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        vocab_size=get("vocab_size"),
        rope=_parse_rope(raw, source, ""),
        mask_token_id=int(get("mask_token_id", nested=True)),
        target_layer_ids=tuple(ids),
        block_size=int(get("block_size", 16, nested=True)),
        target_fingerprint=_fingerprint(dflash.get("target_fingerprint"), source),
    )


def _fingerprint(value: Any, source: str) -> str | None:
    """dflash_config.target_fingerprint: absent (z-lab's checkpoints) or 16 hex digits."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 16 or any(c not in "0123456789abcdef" for c in value):
        raise ConfigError(f"{source}: `dflash_config.target_fingerprint` must be 16 lowercase hex digits, "
                          f"got {value!r}")
    return value
