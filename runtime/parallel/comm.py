"""One rank's view of the tensor-parallel group: `Comm` and the process-group set-up.

`Comm` wraps a torch.distributed process group (gloo on CPU, NCCL on CUDA) with the collectives the
model needs.  Every collective works in place or into a caller-visible buffer on the current CUDA
stream with async_op=False and no host synchronisation, so NCCL calls are recorded into a CUDA graph
when issued under capture (the NCCL communicator must exist before capture: NCCL inits eagerly
through `device_id`, and a warm-up collective runs before any capture).

Later option, not now: the per-layer all-reduces are small ([n x 7168] bf16 for n <= 257 tree
nodes, 2 per layer x 61 layers per round) and latency-bound; a custom one-shot all-reduce (each rank
reads every peer's buffer over NVLink P2P and sums locally, one kernel, no NCCL protocol overhead)
is the known next step once benchmarks/allreduce.py shows NCCL's floor dominating the round.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) `comm_from_env` joins the group torchrun set up.

Fault injection for tests: KDTREE_FAULT_RANK=r makes rank r fail; KDTREE_FAULT_KIND = exit
(os._exit mid-run, default) | raise (an exception mid-run) | start (fails before joining the group);
KDTREE_FAULT_AT=k: the k-th all_reduce of that rank (default 20).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.12 renamed all_gather_into_tensor (the old name warns); same arguments
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class Comm:
    """One rank's view of the tensor-parallel group.  world == 1 still issues the collectives (so
    `--tp 1` under NCCL exercises the same code path, graph capture included)."""

    rank: int
    world: int
    device: torch.device
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)
    _calls: int = field(default=0, repr=False)
    _fault_at: int = field(default=0, repr=False)
    _fault_kind: str = field(default="", repr=False)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks, in place; returns t."""
        self._calls += 1
        if self._fault_at and self._calls == self._fault_at:
            _inject_fault(self.rank, self._fault_kind)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape everywhere) along `dim`, rank order."""
        t = t.contiguous()
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)  # ranks on dim 0
        _all_gather_single(out, t, group=self.group)
        out = out.view(self.world, *t.shape)  # [world, ...]
        dim = dim % t.dim()
        return torch.cat(out.unbind(0), dim=dim) if self.world > 1 else out[0]

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `t` with rank src's, in place; returns t."""
        dist.broadcast(t, src=src, group=self.group)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def init_comm(rank: int, world: int, device: str | torch.device = "cpu", init_method: str = "env://",
              timeout_s: float = 600.0) -> Comm:
    """Join the group as `rank` of `world` (gloo for CPU, NCCL for CUDA) and return its Comm."""
    fault_rank = os.environ.get("KDTREE_FAULT_RANK")
    kind = os.environ.get("KDTREE_FAULT_KIND", "exit")
    faulty = fault_rank is not None and int(fault_rank) == rank
    if faulty and kind == "start":
        raise RuntimeError(f"injected start-up failure on rank {rank} (KDTREE_FAULT_KIND=start)")
    device = torch.device(device)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL init: the communicator exists before any graph capture
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    comm = Comm(rank, world, device)
    if faulty:
        comm._fault_at, comm._fault_kind = int(os.environ.get("KDTREE_FAULT_AT", "20")), kind
    return comm


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) started this process as one rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def comm_from_env(device: str | torch.device = "cpu") -> Comm:
    """The Comm of a process started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK)."""
    if not under_torchrun():
        raise RuntimeError("comm_from_env: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are not all set")
    return init_comm(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _inject_fault(rank: int, kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {rank} (KDTREE_FAULT_KIND=raise)")
    os._exit(3)  # a hard crash: no exception, no clean-up

