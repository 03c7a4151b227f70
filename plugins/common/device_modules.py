"""Kernels loaded once per CUDA device: the loaded object, or why it does not load there (remembered for the process,
one warning).  The launchers of the CUDA C plugins (skinny_gemm, skinny_wgmma, tree_verify_wgmma, l2_prefetch) ask
it (in their `available(device)`, or at a launch); the first ask loads, never inside a CUDA graph capture (nothing is
allocated in a capture's pool: the runtime's warm-up calls come first).  moe_w4a16's launch_v3 keeps its own table:
its `unavailable` returns the reason for the loader's MoEKernelWarning instead of warning itself."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from plugins.common.cubin import CubinUnavailable

T = TypeVar("T")


class NotForThisDevice(Exception):
    """Raised by a loader for a device its kernels are not written for (e.g. no wgmma): remembered, not warned."""


class PerDevice(Generic[T]):
    """The loaded kernels of each device index.  what: the name in the warning; warning: its category; fallback:
    what runs instead, appended to the warning ("; ..."), or ""."""

    def __init__(self, what: str, warning: type[UserWarning], fallback: str = "") -> None:
        self.what, self.warning, self.fallback = what, warning, fallback
        self.loaded: dict[int, T] = {}
        self.why_not: dict[int, str] = {}  # device index -> why it does not load (final per process)

    @staticmethod
    def index(device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def __getitem__(self, device: torch.device) -> T:
        """The device's loaded object (get() said it loads)."""
        return self.loaded[self.index(device)]

    def get(self, device: torch.device, load: Callable[[torch.device], T]) -> T | None:
        """The device's loaded object, load(torch.device("cuda", index)) at the first ask; None on a non-CUDA device,
        inside a capture before the first load, and where load raised (CubinUnavailable, ImportError, RuntimeError: one
        warning naming why; NotForThisDevice: no warning), which later asks remember."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = self.index(device)
        found = self.loaded.get(index)
        if found is not None or index in self.why_not or torch.cuda.is_current_stream_capturing():
            return found
        try:
            found = load(torch.device("cuda", index))
        except NotForThisDevice as exc:
            self.why_not[index] = str(exc)
            return None
        except (CubinUnavailable, ImportError, RuntimeError) as exc:
            self.why_not[index] = f"{type(exc).__name__}: {exc}"
            warnings.warn(self.warning(f"{self.what} unavailable on cuda:{index} ({self.why_not[index]})"
                                       + (f"; {self.fallback}" if self.fallback else "")), stacklevel=3)
            return None
        self.loaded[index] = found
        return found

    def require(self, device: torch.device, load: Callable[[torch.device], T]) -> T:
        """get(device, load), or RuntimeError naming why the kernels are not loaded there (the reason get()
        remembered, or a first call inside a CUDA graph capture)."""
        found = self.get(device, load)
        if found is None:
            device = torch.device(device)
            why = self.why_not.get(self.index(device), "first call inside a CUDA graph capture; call it once before "
                                   "capturing") if device.type == "cuda" else "not a CUDA device"
            raise RuntimeError(f"{self.what}: not loaded on {device}: {why}")
        return found
