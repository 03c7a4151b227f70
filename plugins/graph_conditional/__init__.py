"""The setter kernel of budget auto's conditional graph nodes (set_conditionals.cu) as a cubin for one GPU arch.

A captured budget-auto round (runtime/decode/conditional.py) holds one SWITCH node over the tree-size buckets
(or, where the driver or an older cubin lacks it, one IF node per bucket); a kernel node right before it sets
the conditional handle(s) from the device's one-hot choice (cudaGraphSetConditional, callable only from device
code).  setter_cubin hands out that kernel's cubin
from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py says in which order).
"""

from __future__ import annotations

from pathlib import Path

from plugins.common.cubin import cubin

SOURCE = Path(__file__).with_name("set_conditionals.cu")
KERNEL = b"kdtree_set_conditionals"  # IF nodes: (const u64* handles [n], const bool* hot [n], int n)
SWITCH_KERNEL = b"kdtree_set_switch"  # a SWITCH node: (u64 handle, const bool* hot [n], int n)


def setter_cubin(arch: str, cache: Path) -> tuple[bytes, str]:
    """(cubin bytes, where it came from) for arch "sm_90" etc.; cache: the kdtree cache root."""
    return cubin(SOURCE, arch, cache)
