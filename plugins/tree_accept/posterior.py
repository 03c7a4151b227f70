"""posterior: the target's token after every tree node, from the verify logits, in one fused GPU pass.

Shapes: logits [b, ..., V] (e.g. [b, N, V]) fp32/bf16/fp16 -> out [b, ...] int64; state [b, 2] int64 = (seed,
counter) and inv_temp [b] fp32 = 1 / T per request, on the device, so one captured graph serves every T > 0
and every mix of requests.

  greedy   argmax over V, ties to the lowest id (as torch.argmax); state is left as it is.
  sampled  a sample of softmax(logits * inv_temp) per row by Gumbel-max: argmax_i(logits_i * inv_temp -
           log(-log u_i)) with plugins/common/rng.py's counter-based uniforms u (splitmix64 of the request's
           seed and counter and the element's index within the request's slice, so a request draws the same
           whatever else is in the batch).  The kernel reads seed, counter and inv_temp from device memory, and
           the op then advances state[:, 1] by one (a second, stream-ordered launch), so a captured CUDA graph
           draws fresh numbers on every replay.

The CPU path is plugins.common.rng.choose(logits, greedy, state, inv_temp) itself, and the kernel computes
the same uniforms bit for bit; the race values agree up to the last bits of log (libdevice vs the CPU's), so
a sample can differ only where two candidates' race values are within a few ulps (rare; the tests report
the agreement rate).  NaN logits give an unspecified token; the optional nonfinite [b] output flags the
requests whose logits held a NaN or Inf (the round's non-finite guard, in the same pass over the logits).
"""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.op import kdtree_op
from plugins.common.rng import choose


def posterior_reference(logits: torch.Tensor, greedy: bool, state: torch.Tensor, inv_temp: torch.Tensor
                        ) -> torch.Tensor:
    """logits [b, ..., V] -> token ids [b, ...] int64: plugins.common.rng.choose (argmax when greedy, else a
    sample of softmax(logits * inv_temp) drawn from each request's state (seed, counter), advanced by one)."""
    return choose(logits, greedy, state, inv_temp)


def nonfinite_reference(logits: torch.Tensor) -> torch.Tensor:
    """logits [b, ..., V] -> [b] bool: the request's logits hold a NaN or an Inf."""
    return (~torch.isfinite(logits)).reshape(logits.shape[0], -1).any(1)


@kdtree_op("posterior", mutates_args=("state", "out", "nonfinite"))
def posterior(logits: torch.Tensor, greedy: bool, state: torch.Tensor, inv_temp: torch.Tensor,
              out: torch.Tensor, nonfinite: Optional[torch.Tensor] = None) -> None:
    """Writes out [b, ...] int64 = the token chosen after each row of logits [b, ..., V]: argmax when greedy,
    else a sample of softmax(logits * inv_temp [b] fp32); state [b, 2] int64 (seed, counter per request)
    advances by one when sampling.  nonfinite [b] int64 (optional): set to 1 for a request whose logits hold a
    NaN or Inf, left as it is otherwise (its reader clears it: runtime/decode/round.py)."""
    _check(logits, state, inv_temp, out, nonfinite)
    if nonfinite is not None:
        nonfinite.masked_fill_(nonfinite_reference(logits), 1)
    out.copy_(posterior_reference(logits, greedy, state, inv_temp))


@posterior.register_kernel("cuda")
def _posterior_cuda(logits: torch.Tensor, greedy: bool, state: torch.Tensor, inv_temp: torch.Tensor,
                    out: torch.Tensor, nonfinite: Optional[torch.Tensor] = None) -> None:
    _check(logits, state, inv_temp, out, nonfinite)
    posterior_triton(logits, greedy, state, inv_temp, out, nonfinite=nonfinite)


def _check(logits: torch.Tensor, state: torch.Tensor, inv_temp: torch.Tensor, out: torch.Tensor,
           nonfinite: Optional[torch.Tensor] = None) -> None:
    if logits.dim() < 2 or logits.shape[-1] < 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"posterior: logits must be floating [b, ..., V >= 1], got {logits.dtype} "
                         f"{list(logits.shape)}")
    b = logits.shape[0]
    if tuple(out.shape) != tuple(logits.shape[:-1]) or out.dtype != torch.int64:
        raise ValueError(f"posterior: out must be torch.int64 {list(logits.shape[:-1])}, got {out.dtype} "
                         f"{list(out.shape)}")
    if tuple(state.shape) != (b, 2) or state.dtype != torch.int64 or state.device != logits.device \
            or not state.is_contiguous():
        raise ValueError(f"posterior: state must be contiguous torch.int64 [{b}, 2] (seed, counter per request) on "
                         f"{logits.device}, got {state.dtype} {list(state.shape)} on {state.device}")
    if tuple(inv_temp.shape) != (b,) or inv_temp.dtype != torch.float32 or inv_temp.device != logits.device \
            or not inv_temp.is_contiguous():
        raise ValueError(f"posterior: inv_temp must be contiguous torch.float32 [{b}] (1 / T per request) on "
                         f"{logits.device}, got {inv_temp.dtype} {list(inv_temp.shape)} on {inv_temp.device}")
    if out.device != logits.device:
        raise ValueError(f"posterior: out is on {out.device}, logits on {logits.device}")
    if nonfinite is not None and (tuple(nonfinite.shape) != (b,) or nonfinite.dtype != torch.int64
                                  or nonfinite.device != logits.device or not nonfinite.is_contiguous()):
        raise ValueError(f"posterior: nonfinite must be contiguous torch.int64 [{b}] on {logits.device}, got "
                         f"{nonfinite.dtype} {list(nonfinite.shape)} on {nonfinite.device}")


def posterior_triton(logits: torch.Tensor, greedy: bool, state: torch.Tensor, inv_temp: torch.Tensor,
                     out: torch.Tensor, block_v: int = 4096, num_warps: int = 8,
                     nonfinite: torch.Tensor | None = None) -> None:
    """The fused kernel: one program per row, a running per-lane (value, index) over V in block_v chunks."""
    import triton

    from plugins.common.pdl import pdl_args, pdl_for
    from plugins.tree_accept.posterior_kernel import posterior_kernel
    v = logits.shape[-1]
    rows = out.numel()
    if rows == 0:
        return
    if logits.stride(-1) != 1:
        raise ValueError(f"posterior: logits must have a contiguous last dim, got strides {logits.stride()}")
    if not out.is_contiguous():
        raise ValueError("posterior: out must be contiguous")
    flat = logits.reshape(rows, v)  # [rows, V]; a view for the usual contiguous [b, N, V]
    block = min(block_v, max(triton.next_power_of_2(v), 16))
    posterior_kernel[(rows,)](flat, out.view(rows), state, inv_temp, nonfinite if nonfinite is not None else state,
                              v, flat.stride(0), rows // logits.shape[0], SAMPLE=not greedy,
                              FLAG=nonfinite is not None, BLOCK_V=block, num_warps=num_warps,
                              **pdl_args(pdl_for(logits)))
    if not greedy:
        state[:, 1].add_(1)
