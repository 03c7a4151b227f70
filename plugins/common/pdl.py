"""Programmatic dependent launch (PDL, sm_90+) for the decode round's Triton kernels.

A kernel launched with the PDL attribute may be scheduled while its predecessor in the stream is still
running: its launch and ramp overlap the predecessor's tail instead of following its completion (~0.5-1 µs a
boundary, measured on tree_verify_mla's combine: plugins/tree_verify_mla/NOTES.md).  Correctness rests on one
rule: such a kernel starts with pdl_prologue, which waits (griddepcontrol.wait) until the predecessor grid has
completed and its memory is visible, then lets its own dependents launch.  So nothing is read early, and a
kernel launched without the attribute (torch's, cuBLAS's) still follows full completion.  In a captured graph
the attribute becomes a programmatic edge.

Who uses it: every layer_fusion kernel, drafter_attention, tree_verify_mla, the MoE's route / combine (and v3's
CUDA C kernels, launch_v3.py), tree_build's five kernels, round_emit, the TP greedy token's two kernels, and
tree_accept, posterior and kv_commit's two (their aot.py specialisations compile PDL in: without the launch
attribute the wait returns at once).

KDTREE_PDL=0 (read at import) launches every kernel without it: the peer the benchmarks measure.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from core.env_flags import env_flag
from plugins.common.device import device_facts

USE_PDL = env_flag("KDTREE_PDL", True)


def pdl_for(t: torch.Tensor) -> bool:
    """Launch with PDL: on by default, a CUDA tensor (not the interpreter) of an sm_90+ device."""
    return USE_PDL and t.is_cuda and device_facts(t.device).capability[0] >= 9


def pdl_args(pdl: bool) -> dict:
    """A launch's PDL keywords: the kernel's PDL constexpr (pdl_prologue) and, with pdl, the launch attribute (the
    interpreter takes no launch options)."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a PDL-launched kernel: wait for the predecessor grid, then release dependents."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
