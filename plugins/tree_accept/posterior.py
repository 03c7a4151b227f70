"""posterior: the target's token after every tree node, from the verify logits, in one fused GPU pass.

Shapes: logits [..., V] (e.g. [b, N, V]) fp32/bf16/fp16 -> out [...] int64; state [2] int64 = (seed, counter).

  T = 0   argmax over V, ties to the lowest id (as torch.argmax).
  T > 0   a sample of softmax(logits / T) per row by Gumbel-max: argmax_i(logits_i / T - log(-log u_i))
          with runtime/rng.py's counter-based uniforms u (splitmix64 of seed, counter and the flat element
          index).  The kernel reads seed and counter from the device tensor `state`, and the op then
          advances state[1] by one (a second, stream-ordered launch), so a captured CUDA graph draws
          fresh numbers on every replay.

CPU and GPU draw the same samples: the CPU path is runtime.rng.choose, and the kernel computes the same
uniforms bit for bit; the race values agree up to the last bits of log (libdevice vs the CPU's), so a
sample can differ only where two candidates' race values are within a few ulps (rare; the GPU test
reports the agreement rate).  NaN logits give an unspecified token.
"""

from __future__ import annotations

import torch

from runtime.rng import choose


def posterior_reference(logits: torch.Tensor, temperature: float, state: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> token ids [...] int64: argmax at T <= 0, else runtime.rng.choose's sample of
    softmax(logits / T) drawn from state (seed, counter), which it advances by one."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    inv_temp = torch.tensor([1.0 / temperature], dtype=torch.float32, device=logits.device)
    return choose(logits, False, state, inv_temp)


@torch.library.custom_op("kdtree::posterior", mutates_args=("state", "out"))
def posterior(logits: torch.Tensor, temperature: float, state: torch.Tensor, out: torch.Tensor) -> None:
    """Writes out [...] int64 = the token chosen after each row of logits [..., V]; state [2] int64
    (seed, counter) is advanced by one at T > 0."""
    _check(logits, state, out)
    out.copy_(posterior_reference(logits, temperature, state))


@posterior.register_kernel("cuda")
def _posterior_cuda(logits: torch.Tensor, temperature: float, state: torch.Tensor, out: torch.Tensor) -> None:
    _check(logits, state, out)
    posterior_triton(logits, temperature, state, out)


def _check(logits: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> None:
    if logits.dim() < 1 or logits.shape[-1] < 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"posterior: logits must be floating [..., V >= 1], got {logits.dtype} {list(logits.shape)}")
    if tuple(out.shape) != tuple(logits.shape[:-1]) or out.dtype != torch.int64:
        raise ValueError(f"posterior: out must be torch.int64 {list(logits.shape[:-1])}, got {out.dtype} "
                         f"{list(out.shape)}")
    if tuple(state.shape) != (2,) or state.dtype != torch.int64 or state.device != logits.device:
        raise ValueError(f"posterior: state must be torch.int64 [2] (seed, counter) on {logits.device}, got "
                         f"{state.dtype} {list(state.shape)} on {state.device}")
    if out.device != logits.device:
        raise ValueError(f"posterior: out is on {out.device}, logits on {logits.device}")


def posterior_triton(logits: torch.Tensor, temperature: float, state: torch.Tensor, out: torch.Tensor,
                     block_v: int = 4096, num_warps: int = 8) -> None:
    """The fused kernel: one program per row, a running per-lane (value, index) over V in block_v chunks."""
    import triton

    from plugins.tree_accept.posterior_kernel import posterior_kernel
    v = logits.shape[-1]
    rows = out.numel()
    if rows == 0:
        return
    if logits.stride(-1) != 1:
        raise ValueError(f"posterior: logits must have a contiguous last dim, got strides {logits.stride()}")
    flat = logits.reshape(rows, v)  # a view for the usual contiguous [b, N, V]
    out_flat = out.view(rows) if out.is_contiguous() else None
    if out_flat is None:
        raise ValueError("posterior: out must be contiguous")
    sample = temperature > 0
    block = min(block_v, max(triton.next_power_of_2(v), 16))
    posterior_kernel[(rows,)](flat, out_flat, state, v, flat.stride(0), 1.0 / temperature if sample else 1.0,
                              SAMPLE=sample, BLOCK_V=block, num_warps=num_warps)
    if sample:
        state[1:].add_(1)
