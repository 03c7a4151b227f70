"""What several ops share: packed ancestor bitmasks (bitmask), the references' accumulation dtype
(precision), SiLU * up in torch and in Triton (activation, activation_kernel),
order-preserving packed int64 keys for Triton reductions (keys), the counter-based token
sampler (rng), the device facts the launch heuristics read (device), an op's scratch as one flat byte
buffer carved per call (workspace), and the description of an AOT-compiled Triton kernel (aot).
Imports core only, never an op (tests/test_layers.py)."""
