"""An op's scratch as one flat byte buffer, carved into typed views per call.

A custom op takes tensors only, so an op's workspace crosses the op boundary as one contiguous uint8
tensor [nbytes] that the caller allocates once for a capacity (the largest call it will make) and
passes to every call; the op carves the views this call's static shapes need from its start (each
view 256-byte aligned), so it allocates nothing and a CUDA graph captures the same addresses.
"""

from __future__ import annotations

import math

import torch

ALIGN = 256  # bytes; every view starts on a multiple (coalesced, and any dtype's alignment)

Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one view


def _sizes(specs: list[Spec]) -> list[int]:
    return [-(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN for shape, dtype in specs]


def workspace_bytes(specs: list[Spec]) -> int:
    """Bytes of a buffer holding every view of specs, each 256-byte aligned."""
    return sum(_sizes(specs))


def carve(buffer: torch.Tensor, specs: list[Spec], op: str, call: str) -> list[torch.Tensor]:
    """The views of specs, in order, from the start of buffer [nbytes] uint8; `op` and `call` (this call's
    shapes, in words) name what was needed in the one error raised when the buffer is too small."""
    need = workspace_bytes(specs)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{op}: workspace must be a contiguous 1-D uint8 tensor (its .buffer), got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    if buffer.numel() < need:
        raise ValueError(f"{op}: workspace holds {buffer.numel()} bytes, this call ({call}) needs {need}: "
                         f"allocate it for a capacity at least this call's")
    views, offset = [], 0
    for (shape, dtype), size in zip(specs, _sizes(specs)):
        views.append(buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        offset += size
    return views
