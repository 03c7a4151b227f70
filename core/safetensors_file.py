"""A strict, memory-mapped reader for one .safetensors file.

Format: u64 little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data section.
Everything is validated before any tensor is handed out, so a truncated or malformed shard fails
with one line naming the file (and the tensor) instead of a crash deep inside a forward pass.
Nothing is unpickled and no code from the checkpoint runs.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import CheckpointError

# safetensors dtype tag -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int


class SafetensorsFile:
    """Validated header of one shard plus lazy, zero-copy access to its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: shard file not found") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated ({size} bytes, shorter than the 8-byte header length)")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CheckpointError(f"{self.path}: header length {header_len} runs past end of file ({size} bytes)")
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{self.path}: header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.data_len = size - self.data_start
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = self._parse_entry(name, info)
        self._check_layout()
        self._mmap: mmap.mmap | None = None

    def _parse_entry(self, name: str, info: object) -> TensorEntry:
        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path}: tensor {name!r}: header entry is not an object")
        tag = info.get("dtype")
        if tag not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r}: unknown dtype {tag!r}")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(f"{self.path}: tensor {name!r}: bad shape {shape!r}")
        offsets = info.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{self.path}: tensor {name!r}: bad data_offsets {offsets!r}")
        dtype, itemsize = DTYPES[tag]
        nbytes = math.prod(shape) * itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes "
                                  f"but dtype {tag} x shape {shape} needs {nbytes}")
        return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])

    def _check_layout(self) -> None:
        prev: TensorEntry | None = None
        for e in sorted(self.entries.values(), key=lambda e: (e.begin, e.end)):
            if e.end > self.data_len:
                raise CheckpointError(f"{self.path}: tensor {e.name!r}: data_offsets end {e.end} is past the data "
                                      f"section ({self.data_len} bytes): file truncated or offsets out of range")
            if prev is not None and e.begin < prev.end and e.end > e.begin:
                raise CheckpointError(f"{self.path}: tensors {prev.name!r} and {e.name!r} overlap "
                                      f"([{prev.begin}, {prev.end}) and [{e.begin}, {e.end}))")
            if e.end > e.begin:
                prev = e

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of a tensor (copy-on-write mapping: writes never reach the file)."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not in this shard")
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=e.end - e.begin, offset=self.data_start + e.begin)
        return flat.view(e.dtype).reshape(e.shape)

    def close(self) -> None:
        self._mmap = None  # views keep the mapping alive until they are freed
