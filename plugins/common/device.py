"""Device facts the launch heuristics read, per device: queried where the driver can tell, else a table.

SM count, compute capability and L2 size come from torch.cuda.get_device_properties (no host sync, cached per
device index).  Memory bandwidth and the dense bf16 tensor rate cannot be queried, so their ratio
(bytes per flop: where a kernel turns from memory- to compute-bound) comes from a table keyed by the
compute capability (major, minor); an arch not in the table takes the sm_90 row.  The rooflines the benchmarks
report divide by copy_bytes_per_s instead: the device's copy rate, measured once (an H100 and an H200 share sm_90).

Without a CUDA device (CPU tensors under TRITON_INTERPRET=1, meta tensors) the facts are the H200's,
the machine the heuristics were tuned on, so a CPU test plans the same launches as that GPU would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# (major, minor) -> (memory bytes/s, dense bf16 tensor flop/s, the source)
RATES: dict[tuple[int, int], tuple[float, float, str]] = {
    (9, 0): (4.25e12, 687e12, "H200, measured: device copy 4.25 TB/s, bf16 GEMM 687 TFLOP/s (DESIGN.md)"),
    (12, 0): (1.792e12, 500e12, "RTX PRO 6000 Blackwell, datasheet, not measured: 1792 GB/s GDDR7; ~1 PFLOP/s "
                                "bf16 with 2:4 sparsity, so ~500 TFLOP/s dense (assumption)"),
}
DEFAULT_CAPABILITY = (9, 0)  # the table row for an unlisted arch, and the arch assumed without a CUDA device
DEFAULT_SMS = 132  # the H200's SM count, used without a CUDA device
DEFAULT_L2_BYTES = 50 << 20  # the H200's L2 (as the H100's), used without a CUDA device


@dataclass(frozen=True)
class DeviceFacts:
    sms: int  # streaming multiprocessors
    capability: tuple[int, int]  # (major, minor); (9, 0) without a CUDA device
    bytes_per_flop: float  # memory bandwidth / dense bf16 tensor rate (from RATES)
    l2_bytes: int = DEFAULT_L2_BYTES  # the L2 cache

    @property
    def arch(self) -> str:
        """The capability in --arch's vocabulary ("sm_90"): where kernels of this device sit in an artifact."""
        return arch_of(self.capability)


def arch_of(capability: tuple[int, int]) -> str:
    """(9, 0) -> "sm_90"."""
    return f"sm_{capability[0]}{capability[1]}"


def device_facts(device: torch.device | str | None) -> DeviceFacts:
    """The facts of the device a tensor lives on (pass tensor.device); the H200's for CPU, meta or None."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return facts_for(DEFAULT_SMS, DEFAULT_CAPABILITY)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_facts(index)


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    return facts_for(props.multi_processor_count, (props.major, props.minor), props.L2_cache_size)


def facts_for(sms: int, capability: tuple[int, int], l2_bytes: int = DEFAULT_L2_BYTES) -> DeviceFacts:
    """The facts of a device with this SM count, compute capability and L2 (e.g. to plan for another GPU)."""
    bandwidth, flops, _ = RATES.get(capability, RATES[DEFAULT_CAPABILITY])
    return DeviceFacts(sms, capability, bandwidth / flops, l2_bytes)


def tensor_flops_per_s(device: torch.device | str | None) -> float:
    """The dense bf16 tensor rate rooflines divide flops by: the table's (RATES) for the device's arch (the H200's
    measured GEMM rate for sm_90, the H100 included: the same SMs at about the same clock)."""
    return RATES.get(device_facts(device).capability, RATES[DEFAULT_CAPABILITY])[1]


def copy_bytes_per_s(device: torch.device | str | None) -> float:
    """The memory rate rooflines divide by: bytes read + written per second by a device-to-device copy, measured
    once per CUDA device (how DESIGN.md measured the H200's 4.25 TB/s), so that a run on an H100 divides by the
    H100's rate; off CUDA the table's rate (RATES: the H200's for sm_90)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return RATES[DEFAULT_CAPABILITY][0]
    return _measured_copy_rate(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _measured_copy_rate(index: int, nbytes: int = 512 << 20, iters: int = 10) -> float:
    """The best of `iters` copies of nbytes (ten times the L2) on CUDA device `index`, timed with events."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best
