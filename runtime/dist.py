"""Ranks for tensor / expert parallelism: the `Comm` handle, process-group set-up and the launcher.

`Comm` wraps a torch.distributed process group (gloo on CPU, NCCL on CUDA) with the four
collectives the model needs.  Every collective works in place or into a caller-visible buffer on the
current CUDA stream with async_op=False and no host synchronisation, so NCCL calls are recorded into
a CUDA graph when issued under capture (the NCCL communicator must exist before capture: NCCL inits
eagerly through `device_id`, and a warm-up collective runs before any capture).

Later option, not now: the per-layer all-reduces are small ([n x 7168] bf16 for n <= 257 tree
nodes, 2 per layer x 61 layers per round) and latency-bound; a custom one-shot all-reduce (each rank
reads every peer's buffer over NVLink P2P and sums locally, one kernel, no NCCL protocol overhead)
is the known next step once benchmarks/allreduce.py shows NCCL's floor dominating the round.

Launch: `launch(worker, world, args)` starts `world` processes (forkserver on CPU, spawn on CUDA),
rank r calls `worker(comm, *args)`; results come back per rank.  `RankGroup` keeps ranks alive
between requests (the multi-rank Engine: runtime/tp_engine.py, reached through `load_engine`).  A
rank that fails to start, raises or dies (any exit code, a signal) ends the run: the others are
terminated (SIGTERM, then SIGKILL) and `RankFailure` names the rank (a rank whose collective broke
because a peer died is not blamed: the dead peer is).  Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) `comm_from_env`
joins the group torchrun set up instead; torchrun then owns failure handling.

Fault injection for tests: KDTREE_FAULT_RANK=r makes rank r fail; KDTREE_FAULT_KIND = exit
(os._exit mid-run, default) | raise (an exception mid-run) | start (fails before joining the group);
KDTREE_FAULT_AT=k: the k-th all_reduce of that rank (default 20).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from build_pipeline.errors import KdtreeError


# torch >= 2.12 renamed all_gather_into_tensor (the old name warns); same arguments
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class RankFailure(KdtreeError):
    """A rank failed to start or died mid-run; `rank` names it, `pids` lists every rank's process."""

    def __init__(self, rank: int, message: str, pids: list[int] | None = None):
        super().__init__(f"rank {rank} {message}")
        self.rank, self.pids = rank, pids or []


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


# ---- process-group set-up ----

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


# ---- launcher ----

class RankGroup:
    """`world` spawned rank processes, each running entry(comm, conn, *args) with `conn` its pipe to
    this process.  `messages()` yields (rank, kind, payload) as ranks send them and turns any failure
    into RankFailure after stopping every rank: a rank that sends ("error", traceback), exits
    without having sent ("ok", ...), or is killed by a signal."""

    def __init__(self, entry: Callable[..., Any], world: int, args: tuple = (), device: str = "cpu",
                 grace_s: float = 3.0):
        if world < 1:
            raise ValueError(f"--tp must be >= 1, got {world}")
        self.world, self.grace_s = world, grace_s
        self.procs: list = []
        self.conns: list = []
        self.finished: set[int] = set()  # ranks that sent ("ok", ...): their exit is expected
        self.closed = False
        ctx = _mp_context(device)
        init = f"tcp://127.0.0.1:{_free_port()}"
        try:
            for rank in range(world):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_rank_main, name=f"kdtree-rank{rank}", daemon=True,
                                args=(entry, rank, world, device, init, args, child_end, dict(os.environ)))
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, rank: int, msg: Any) -> None:
        try:
            self.conns[rank].send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            for _ in self.messages():  # ends in RankFailure naming the rank that died
                pass

    def messages(self):
        """Yield (rank, kind, payload) forever (the caller stops iterating); raise RankFailure on failure."""
        live = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while True:
            for obj in mpc.wait(list(live) + list(sentinels)):
                if obj in live:
                    rank = live[obj]
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):  # closed without a word: its exit status decides below
                        del live[obj]
                        continue
                    yield from self._judge(rank, kind, payload)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self.conns[rank]
                    while conn in live and conn.poll():  # messages sent just before it exited
                        try:
                            kind, payload = conn.recv()
                        except (EOFError, OSError):
                            break
                        yield from self._judge(rank, kind, payload)
                    live.pop(conn, None)
                    self.procs[rank].join()
                    code = self.procs[rank].exitcode
                    if not (code == 0 and rank in self.finished):
                        self._fail(rank, f"died ({_describe_exit(code)}) before finishing; the run was stopped")

    def messages_until(self, done: Callable[[], bool]):
        """messages() until done() is true (checked before each wait)."""
        if done():
            return
        for m in self.messages():
            yield m
            if done():
                return

    def _judge(self, rank: int, kind: str, payload: Any):
        if kind == "error":
            dead = self._died_silently(rank)
            if dead is not None:  # rank's error is most likely the collective broken by dead's exit
                code = self.procs[dead].exitcode
                last = str(payload).strip().splitlines()[-1] if str(payload).strip() else ""
                self._fail(dead, f"died ({_describe_exit(code)}) before finishing; the run was stopped "
                                 f"(rank {rank} then failed: {last})")
            self._fail(rank, f"failed:\n{payload}")
        if kind == "ok":
            self.finished.add(rank)
        yield rank, kind, payload

    def _died_silently(self, rank: int, wait_s: float = 1.0) -> int | None:
        """Another rank that exited abnormally (within wait_s): the root cause of `rank`'s error."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        mpc.wait(list(others), timeout=wait_s)  # returns as soon as one has exited
        for r, p in enumerate(self.procs):
            if r != rank and p.exitcode not in (None, 0) and r not in self.finished:
                try:
                    if self.conns[r].poll():
                        self.conns[r].recv()  # it left a message (its own error): not silent
                        continue
                except (EOFError, OSError):  # closed without a word: it crashed
                    pass
                return r
        return None

    def _fail(self, rank: int, message: str) -> None:
        pids = self.pids
        self.close()
        raise RankFailure(rank, message, pids)

    def close(self) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after grace_s) and close the pipes."""
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(self.grace_s)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


def launch(worker: Callable[..., Any], world: int, args: tuple = (), device: str = "cpu") -> list[Any]:
    """Run worker(comm, *args) on `world` fresh processes (one per rank); return each rank's result.

    `worker` must be a module-level function (spawned processes import it).  On the first failure
    (exception, non-zero exit, signal, or exit without a result) every other rank is terminated and
    RankFailure names the failed rank, with its traceback or exit status.
    """
    group = RankGroup(_run_once, world, (worker, *args), device)
    results: dict[int, Any] = {}
    try:
        for rank, kind, payload in group.messages_until(lambda: len(results) == world):
            if kind == "ok":
                results[rank] = payload
    finally:
        group.close()
    return [results[r] for r in range(world)]


def _run_once(comm: Comm, conn, worker: Callable[..., Any], *args) -> None:
    conn.send(("ok", worker(comm, *args)))


def _rank_main(entry, rank: int, world: int, device: str, init_method: str, args: tuple, conn,
               environ: dict[str, str]) -> None:
    """Body of one spawned rank: the launcher's environment as of the launch (a forkserver child
    would otherwise see the server's), die with the parent, join the group, run, report failures."""
    os.environ.clear()
    os.environ.update(environ)
    _die_with_parent()
    # CPU threads per rank: the cores split between ranks (KDTREE_RANK_THREADS overrides; tests use 1,
    # since idle OpenMP threads spinning on a shared machine slow tiny matmuls by orders of magnitude)
    torch.set_num_threads(int(os.environ.get("KDTREE_RANK_THREADS", 0)) or max(1, (os.cpu_count() or 1) // world))
    try:
        comm = init_comm(rank, world, device, init_method)
        entry(comm, conn, *args)
    except BaseException:  # noqa: BLE001 - every failure is reported to the launcher by rank
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    conn.close()
    shutdown()


def _mp_context(device: str):
    """CPU: forkserver where available: one server process imports torch and the model code once, and
    every rank is forked from it (a rank starts in milliseconds instead of re-importing for seconds),
    while like spawn no rank inherits this process's threads.  CUDA: spawn (nothing forked can have
    touched CUDA, whatever a preloaded module does).  KDTREE_MP_START overrides."""
    default = "forkserver" if str(device) == "cpu" and "forkserver" in mp.get_all_start_methods() else "spawn"
    method = os.environ.get("KDTREE_MP_START") or default
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "runtime.model", "runtime.engine"])
    return ctx


def _inject_fault(rank: int, kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {rank} (KDTREE_FAULT_KIND=raise)")
    os._exit(3)  # a hard crash: no exception, no clean-up


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the launcher dies, so no rank outlives a killed run."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_engine(path: str | Path, device: str = "cpu", drafter: str | Path | None = None, spec: str | None = None,
                budget: int = 16, graphs: bool = True, tp: int = 2, ep: bool = False, dtype: torch.dtype | None = None,
                **_):
    """Engine.load(..., tp > 1): under torchrun this process's rank Engine (attribute `rank`; only rank 0
    should print), else a front Engine driving `tp` spawned ranks (runtime/tp_engine.py).  ep: routed
    experts whole per rank."""
    from runtime.tp_engine import TPEngine, rank_engine

    if under_torchrun():
        comm = comm_from_env(device)
        if comm.world != tp:
            raise ValueError(f"--tp {tp}: torchrun started {comm.world} ranks (WORLD_SIZE)")
        return rank_engine(comm, path, drafter, spec, budget, graphs, dtype, ep=ep, tokenizer=True)
    return TPEngine.start(path, device, drafter, spec, budget, graphs, tp, dtype, ep=ep)
