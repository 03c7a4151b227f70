"""Custom ops of the speculative round, one folder per op.

Each op is registered once in the `kdtree::` namespace (`torch.ops.kdtree.<op>`) through
plugins/common/op.py (torch.library.Library: custom_op's wrapper would import torch._dynamo):
the CPU implementation is the op's torch reference (the oracle), the
CUDA implementation is its kernel.  Ops take preallocated outputs and, where they need scratch, a
workspace the caller allocates once for a capacity (optional for now: None allocates per call;
moe_w4a16 still returns a fresh y); they never synchronise with the host, so a round can be captured
in a CUDA graph.  plugins/common holds what several ops share; an op imports only core,
plugins.common and itself (tests/test_layers.py).
"""
