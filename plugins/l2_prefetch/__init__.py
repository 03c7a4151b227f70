"""L2 prefetch of weights (sm_90's bulk prefetch): a hint that lets a latency-bound GEMM read its weights from
L2 instead of HBM, issued while earlier kernels leave HBM idle.  See NOTES.md for what was measured."""
