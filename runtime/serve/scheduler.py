"""Continuous batching at round boundaries: one thread owns the engine and runs its lanes round by round.

Between two rounds the scheduler thread
  1. frees the rows of requests that were cancelled (their client went away, or a stop string
     ended them: the server's handler sets Job.cancelled) and drops cancelled waiting requests,
  2. admits waiting requests (first come, first served) while fewer than `max_batch` hold a row:
     prefill into a free row of their lane (runtime/serve/lanes.py), first token sent at once,
  3. steps every lane that has live rows once and sends each request the tokens it emitted; a
     request that finished leaves its row.
Requests never wait for a cohort: a request joins at the next boundary and the others keep going.

The queue of waiting requests is bounded (`max_queue`: submit raises ApiError 429 when full).  An
exception from the engine while stepping (a dead rank: RankFailure) is fatal: every request gets
503, the scheduler logs one `error:` line and calls `on_fatal` (the server then exits).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from core.errors import NonFiniteLogits
from runtime.serve.lanes import lane_key
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import ApiError, Generation

IDLE_CHECK_S = 1.0  # how often an idle scheduler asks its lanes whether the engine is alive


class Job:
    """A request as the scheduler sees it; events go to the handler's asyncio queue:
    ("tokens", [ids]), ("done", finish_reason) or ("error", ApiError)."""

    def __init__(self, gen: Generation, loop: asyncio.AbstractEventLoop):
        self.gen, self.loop = gen, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled: str | None = None  # the outcome the handler ended it with: "stop" | "cancelled"

    def send(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the server's event loop is closed (shutting down): nobody is listening
            pass


class Scheduler:
    def __init__(self, lanes, max_batch: int, max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[str], None] | None = None):
        """lanes: LocalLanes or RankLanes (get(key) -> a slot batch: admit, step, release, free, active;
        check() raises when the engine died)."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch} and {max_queue}")
        self.lanes, self.max_batch, self.max_queue, self.metrics = lanes, max_batch, max_queue, metrics
        self.on_fatal = on_fatal
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.running: dict[tuple, Job] = {}  # (lane key, row) -> job
        self.admitting: list[Job] = []  # taken off the queue, being prefilled
        self.dead: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kdtree-scheduler", daemon=True)

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    # ---- the handlers' side (event loop thread)
    def submit(self, job: Job) -> None:
        with self.cond:
            if self.dead is not None:
                raise ApiError(503, self.dead)
            if len(self.waiting) + len(self.admitting) + len(self.running) >= self.max_batch + self.max_queue:
                raise ApiError(429, f"the server is busy: {len(self.running)} requests running and {len(self.waiting)}"
                                    f" waiting (--max-batch {self.max_batch}, --max-queue {self.max_queue})")
            self.waiting.append(job)
            self._gauges()
            self.cond.notify()

    def cancel(self, job: Job, outcome: str = "cancelled") -> None:
        """End a request at the next round boundary (a no-op once it finished)."""
        with self.cond:
            if job.cancelled is None:
                job.cancelled = outcome
            self.cond.notify()

    # ---- the scheduler thread
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.running:
                        if not self.cond.wait(timeout=IDLE_CHECK_S):
                            self.lanes.check()  # a rank that died while idle: fail now, not at the next request
                    if self.stopping:
                        return
                    self._drop_cancelled()
                    while self.waiting and len(self.running) + len(self.admitting) < self.max_batch:
                        self.admitting.append(self.waiting.popleft())
                    self._gauges()
                while self.admitting:
                    self._admit(self.admitting[0])
                    with self.cond:
                        self.admitting.pop(0)
                for key in sorted({k for k, _ in self.running}):
                    self._step(key)
                with self.cond:
                    self._gauges()
        except Exception as exc:  # noqa: BLE001 - the engine failed (a dead rank, a bug): nothing more can run
            self._die(exc)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            self.metrics.finished(job.cancelled)
        for (key, row), job in list(self.running.items()):
            if job.cancelled:
                self.lanes.get(key).release(row)
                del self.running[(key, row)]
                self.metrics.finished(job.cancelled)

    def _admit(self, job: Job) -> None:
        g = job.gen
        greedy = g.params.temperature <= 0
        index = 0
        while not self.lanes.get(lane_key(g.spec, greedy, index)).free:  # greedy lanes have max_batch rows
            index += 1
        key = lane_key(g.spec, greedy, index)
        try:
            row, first, live = self.lanes.get(key).admit(g.prompt_ids, g.params)
        except ValueError as exc:  # the request itself is at fault (the engine is fine)
            job.send("error", ApiError(400, str(exc)))
            self.metrics.finished("error")
            return
        except NonFiniteLogits as exc:  # this request's numbers overflowed; the others go on
            job.send("error", ApiError(500, str(exc)))
            self.metrics.finished("error")
            return
        self.metrics.admitted(len(g.prompt_ids))
        job.send("tokens", [first])
        if live:
            with self.cond:
                self.running[(key, row)] = job
        else:
            self._finish(job, [first])

    def _step(self, key) -> None:
        lane = self.lanes.get(key)
        t0 = time.perf_counter()
        emitted = lane.step()
        self.metrics.round(time.perf_counter() - t0, [e.accept_len for e in emitted],
                           sum(len(e.tokens) for e in emitted))
        for e in emitted:
            job = self.running.get((key, e.row))
            if job is None:
                continue
            if e.tokens:
                job.send("tokens", e.tokens)
            if not e.live:
                with self.cond:
                    del self.running[(key, e.row)]
                if e.nonfinite:
                    job.send("error", ApiError(500, "non-finite logits (NaN or Inf) in a decode round: the weights "
                                                    "or activations overflowed; the request was stopped"))
                    self.metrics.finished("error")
                else:
                    self._finish(job, e.tokens)

    def _finish(self, job: Job, last: list[int]) -> None:
        reason = "stop" if last and last[-1] in job.gen.params.stop_ids else "length"
        job.send("done", reason)
        self.metrics.finished(reason)

    def _gauges(self) -> None:
        self.metrics.gauges(len(self.waiting), len(self.running) + len(self.admitting))

    def _die(self, exc: Exception) -> None:
        first = (str(exc).strip().splitlines() or [""])[0]
        msg = f"the engine failed ({type(exc).__name__}: {first}); the server is stopping"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        with self.cond:
            self.dead = msg
            jobs = list(self.running.values()) + self.admitting + list(self.waiting)
            self.running.clear()
            self.admitting.clear()
            self.waiting.clear()
            self._gauges()
        for job in jobs:
            job.send("error", ApiError(503, msg))
            self.metrics.finished("error")
        if self.on_fatal is not None:
            self.on_fatal(msg)
