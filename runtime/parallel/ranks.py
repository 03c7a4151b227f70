"""Rank processes: start `world` of them, watch them, stop them all when one fails.

`launch(worker, world, args)` starts `world` processes (forkserver on CPU, spawn on CUDA), rank r
calls `worker(comm, *args)`; results come back per rank.  `RankGroup` keeps ranks alive between
requests (the multi-rank Engine: runtime/engine/ranks.py).  A rank that fails to start, raises or
dies (any exit code, a signal) ends the run: the others are terminated (SIGTERM, then SIGKILL) and
`RankFailure` names the rank (a rank whose collective broke because a peer died is not blamed: the
dead peer is).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import traceback
from typing import Any, Callable

import torch

from core.errors import KdtreeError
from runtime.parallel.comm import Comm, init_comm, shutdown


class RankFailure(KdtreeError):
    """A rank failed to start or died mid-run; `rank` names it, `pids` lists every rank's process."""

    def __init__(self, rank: int, message: str, pids: list[int] | None = None):
        super().__init__(f"rank {rank} {message}")
        self.rank, self.pids = rank, pids or []


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
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "runtime.model.target", "runtime.engine.engine"])
    return ctx



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

