"""The description of an ahead-of-time compiled Triton kernel: what `plugins/<op>/aot.py` lists and
`kdtree build` (build_pipeline/compile_kernels.py) compiles to a cubin per arch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TritonKernel:
    """One AOT specialisation of a @triton.jit function.

    signature: every parameter -> "*fp32" / "*bf16" / "*i64" / "i32" / "fp32" / "constexpr", ...;
    constexprs: values of the constexpr parameters; attrs: Triton specialisation hints, e.g.
    {(0,): [["tt.divisibility", 16]]} for a 16-byte-aligned first pointer.
    """

    op: str
    name: str  # file stem, unique within the op (e.g. "tree_accept_b64")
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    attrs: dict | None = None
