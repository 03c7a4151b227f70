"""Custom ops of the speculative round, one folder per op.

Each op is registered once as a torch custom op in the `kdtree::` namespace
(`torch.ops.kdtree.<op>`): the CPU implementation is the op's torch reference (the oracle), the
CUDA implementation is its kernel.  Ops take preallocated outputs, never synchronise with the
host and allocate nothing on the kernel path, so a round can be captured in a CUDA graph.
"""
