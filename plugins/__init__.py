"""Custom ops of the speculative round, one folder per op.

Each op is registered once as a torch custom op in the `kdtree::` namespace
(`torch.ops.kdtree.<op>`): the CPU implementation is the op's torch reference (the oracle), the
CUDA implementation is its kernel.  Ops take preallocated outputs and, where they need scratch, a
workspace the caller allocates once for a capacity (optional for now: None allocates per call;
moe_w4a16 still returns a fresh y); they never synchronise with the host, so a round can be captured
in a CUDA graph.  plugins/common holds what several ops share; an op imports only core,
plugins.common and itself (tests/test_layers.py).
"""
