"""Streaming weight loader: checkpoint tensors -> our names, dequantised, one tensor at a time.

Storage per linear weight is detected from the names present:
- `<w>.weight`                                  bf16 / fp16 / fp32, used as is;
- `<w>.weight_packed` + `.weight_scale` (+ `.weight_shape`)   INT4 compressed-tensors;
- `<w>.weight` (float8_e4m3fn) + `.weight_scale_inv`          FP8 with block scales.
Every tensor is checked against the shape the config implies before data is touched; a missing
tensor is named.  Peak memory is one tensor plus what the caller keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from core.checkpoint import Checkpoint
from core.config import QuantConfig
from core.errors import CheckpointError
from core.quant_fp8 import dequantize_fp8_block
from core.quant_int4 import dequantize_int4, unpack_int4
from core.weight_map import TensorSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class WeightLoader:
    """prefix: prepended to every checkpoint name (`language_model.` for kimi_k25); quant: the
    config's quantization_config (INT4 group size / FP8 block shape)."""

    def __init__(self, model_dir: str | Path, prefix: str = "", quant: QuantConfig | None = None):
        self.prefix, self.quant = prefix, quant
        self.ckpt = Checkpoint(model_dir)
        self.where = str(Path(model_dir))

    # ---- name resolution ----
    def _name(self, ckpt_name: str) -> str:
        """Checkpoint name with the prefix; some exports also drop the `model.` that follows it."""
        full = self.prefix + ckpt_name
        if full in self.ckpt:
            return full
        alt = self.prefix + (ckpt_name[len("model."):] if ckpt_name.startswith("model.") else "model." + ckpt_name)
        alt_stem = alt[: -len(".weight")] if alt.endswith(".weight") else alt
        if alt in self.ckpt or alt_stem + ".weight_packed" in self.ckpt:
            return alt
        return full

    def storage(self, spec: TensorSpec) -> str:
        """'plain', 'int4' or 'fp8' for a spec (raises if absent)."""
        base = self._name(spec.ckpt)
        stem = base[: -len(".weight")] if base.endswith(".weight") else base
        if spec.linear and stem + ".weight_packed" in self.ckpt:
            return "int4"
        if base not in self.ckpt:
            raise CheckpointError(f"{self.where}: tensor {base!r} is missing from the checkpoint")
        if spec.linear and stem + ".weight_scale_inv" in self.ckpt:
            return "fp8"
        return "plain"

    def check(self, specs: list[TensorSpec]) -> None:
        """All tensors present with the config's shapes (headers only; no tensor data is read)."""
        missing = []
        for spec in specs:
            try:
                self._check_one(spec)
            except CheckpointError as exc:
                if "is missing from the checkpoint" not in str(exc):
                    raise
                missing.append(self._name(spec.ckpt))
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{self.where}: {len(missing)} tensor(s) missing from the checkpoint: {shown}{more}")

    def _check_one(self, spec: TensorSpec) -> None:
        kind = self.storage(spec)
        base = self._name(spec.ckpt)
        stem = base[: -len(".weight")]
        if kind == "int4":
            group = self._group_size(base)
            out_dim, in_dim = spec.shape
            self._expect(stem + ".weight_packed", (out_dim, in_dim // 8))
            self._expect(stem + ".weight_scale", (out_dim, in_dim // group))
        elif kind == "fp8":
            rows, cols = self._fp8_block()
            self._expect(base, spec.shape)
            self._expect(stem + ".weight_scale_inv", (-(-spec.shape[0] // rows), -(-spec.shape[1] // cols)))
        else:
            self._expect(base, spec.shape)

    def _expect(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.ckpt.shape(name)
        if tuple(got) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name!r} has shape {list(got)}, config implies {list(shape)}")

    def _group_size(self, base: str) -> int:
        q = self.quant
        if q is None or q.kind != "int4":
            raise CheckpointError(f"{self.where}: tensor {base!r} is INT4-packed but config.json has no "
                                  f"compressed-tensors `quantization_config`")
        return q.group_size

    def _fp8_block(self) -> tuple[int, int]:
        return self.quant.block if self.quant is not None and self.quant.kind == "fp8" else (128, 128)

    # ---- reading ----
    def load(self, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as `dtype` (dequantised exactly in fp32 first when quantised), a fresh copy."""
        self._check_one(spec)
        kind = self.storage(spec)
        base = self._name(spec.ckpt)
        stem = base[: -len(".weight")]
        if kind == "int4":
            packed = self.ckpt.tensor(stem + ".weight_packed")
            scale = self.ckpt.tensor(stem + ".weight_scale")
            self._check_int4_shape(stem, spec)
            return dequantize_int4(packed, scale, self._group_size(base)).to(dtype)
        raw = self.ckpt.tensor(base)
        if kind == "fp8":
            if raw.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{self.where}: tensor {base!r} has a weight_scale_inv but dtype {raw.dtype}, "
                                      f"not float8_e4m3fn")
            return dequantize_fp8_block(raw, self.ckpt.tensor(stem + ".weight_scale_inv"), self._fp8_block()).to(dtype)
        if raw.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{self.where}: tensor {base!r} has dtype {raw.dtype}; expected a float type")
        return raw.to(dtype=dtype, copy=True)

    def load_int4(self, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw (int8 values [out, in] in [-8, 7], fp32 scales [out, in/group]) of an INT4 weight."""
        if self.storage(spec) != "int4":
            raise CheckpointError(f"{self.where}: tensor {self._name(spec.ckpt)!r} is not INT4-packed")
        self._check_one(spec)
        stem = self._name(spec.ckpt)[: -len(".weight")]
        self._check_int4_shape(stem, spec)
        return unpack_int4(self.ckpt.tensor(stem + ".weight_packed")), self.ckpt.tensor(stem + ".weight_scale").float()

    def _check_int4_shape(self, stem: str, spec: TensorSpec) -> None:
        if stem + ".weight_shape" in self.ckpt:
            shape = [int(s) for s in self.ckpt.tensor(stem + ".weight_shape").tolist()]
            if shape != list(spec.shape):
                raise CheckpointError(f"{self.where}: tensor {stem + '.weight_shape'!r} says {shape}, "
                                      f"config implies {list(spec.shape)}")

    def stream(self, specs: list[TensorSpec], dtype: torch.dtype) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        """Yield (spec, tensor) one at a time, after checking all specs up front."""
        self.check(specs)
        for spec in specs:
            yield spec, self.load(spec, dtype)
