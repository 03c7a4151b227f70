"""`kdtree_op`: how every op registers in the `kdtree::` namespace (torch.library.Library, not custom_op).

torch.library.custom_op wraps each device kernel in torch._disable_dynamo, whose first call imports
torch._dynamo: 1.7 s here (CPU machine) and 2.8 s of `kdtree run`'s start on the H200, though nothing here is
compiled by Dynamo, and a Python hop per call (its autograd, inplace-view and backend wrappers).  This
registers the same schema (torch.library.infer_schema, as custom_op does) through Library.define / impl /
register_fake: the function is the CompositeExplicitAutograd kernel (every device: the reference), a
register_kernel("cuda") function the CUDA kernel, and an op that returns nothing (it writes its mutable
arguments) gets the fake kernel that returns None.  No autograd kernel: the ops are inference-only (training
uses the references).  The returned KdtreeOp is called like the function; `torch.ops.kdtree.<name>` is the
same op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LIB = torch.library.Library("kdtree", "FRAGMENT")  # the namespace's registrations live as long as the process
OPS: dict[str, "KdtreeOp"] = {}  # every registered op by name


class KdtreeOp:
    """One registered kdtree:: op; `op(...)` dispatches on its tensors' device."""

    def __init__(self, name: str, fn: Callable, mutates_args: Sequence[str]):
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        LIB.define(name + schema)
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        self.name, self.qualname = name, f"kdtree::{name}"
        self.overload = getattr(torch.ops.kdtree, name).default
        self.__doc__, self.__wrapped__ = fn.__doc__, fn
        self.cuda_kernel: Callable | None = None  # the register_kernel("cuda") function, once registered
        OPS[name] = self
        if schema.endswith("-> ()"):
            torch.library.register_fake(self.qualname, _returns_none, lib=LIB)

    def __call__(self, *args, **kwargs):
        return self.overload(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """fn(*args) -> outputs of the right shapes, for torch.export's tracing (ops that return tensors)."""
        torch.library.register_fake(self.qualname, fn, lib=LIB)
        return fn

    def register_kernel(self, device: str) -> Callable[[Callable], Callable]:
        """@op.register_kernel("cuda"): the function run for CUDA tensors instead of the reference."""
        if device != "cuda":
            raise ValueError(f"{self.qualname}: register_kernel takes 'cuda' (the reference serves every other "
                             f"device), got {device!r}")

        def register(fn: Callable) -> Callable:
            LIB.impl(self.name, fn, "CUDA")
            self.cuda_kernel = fn
            return fn

        return register


def _returns_none(*args, **kwargs) -> None:
    return None


def kdtree_op(name: str, mutates_args: Sequence[str]) -> Callable[[Callable], KdtreeOp]:
    """@kdtree_op("rms_norm", mutates_args=()) over the reference: registers kdtree::rms_norm."""
    return lambda fn: KdtreeOp(name, fn, mutates_args)
