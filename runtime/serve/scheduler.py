"""Continuous batching at round boundaries: one thread owns the engine and runs its lanes round by round.

Between two rounds the scheduler thread
  1. frees the rows of requests that were cancelled (their client went away, or a stop string
     ended them: the server's handler sets Job.cancelled) and drops cancelled waiting requests,
  2. gives waiting requests (first come, first served) a free row of their lane
     (runtime/serve/lanes.py) while fewer than `max_batch` hold one,
  3. puts joining prompts into their rows, chunk by chunk (runtime/decode/slots.py): while others
     are running, at most `prefill_budget` prompt tokens per boundary, so a long prompt costs the
     running requests about one chunk per round, not its whole prefill; a request whose prompt is
     all in gets its first token at once and is live from the next round,
  4. steps every lane that has live rows once and sends each request the tokens it emitted; a
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
from runtime.decode.session import PREFILL_CHUNK
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
                 on_fatal: Callable[[str], None] | None = None, prefill_budget: int | None = PREFILL_CHUNK):
        """lanes: LocalLanes or RankLanes (get(key) -> a slot batch: admit, prefill, step, release, free;
        check() raises when the engine died).  prefill_budget: prompt tokens that may go in between two
        rounds while requests are running (at least one chunk); None: whole prompts at once."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch} and {max_queue}")
        self.lanes, self.max_batch, self.max_queue, self.metrics = lanes, max_batch, max_queue, metrics
        self.on_fatal = on_fatal
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.running: dict[tuple, Job] = {}  # (lane key, row) -> job, generating
        self.joining: dict[tuple, Job] = {}  # (lane key, row) -> job, its prompt going in (oldest first)
        self.admitting: list[Job] = []  # taken off the queue, getting a row
        self.prefill_budget = prefill_budget
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
            held = len(self.admitting) + len(self.joining) + len(self.running)
            if len(self.waiting) + held >= self.max_batch + self.max_queue:
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
                    while not self.stopping and not self.waiting and not self.running and not self.joining:
                        if not self.cond.wait(timeout=IDLE_CHECK_S):
                            self.lanes.check()  # a rank that died while idle: fail now, not at the next request
                    if self.stopping:
                        return
                    self._drop_cancelled()
                    while self.waiting and len(self.running) + len(self.joining) + len(self.admitting) < self.max_batch:
                        self.admitting.append(self.waiting.popleft())
                    self._gauges()
                while self.admitting:
                    self._admit(self.admitting[0])
                self._prefill()
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
        for rows in (self.joining, self.running):
            for (key, row), job in list(rows.items()):
                if job.cancelled:
                    self.lanes.get(key).release(row)
                    del rows[(key, row)]
                    self.metrics.finished(job.cancelled)

    def _admit(self, job: Job) -> None:
        """A free row of the request's lane; its prompt goes in by _prefill."""
        g = job.gen
        key = lane_key(g.spec, g.params.temperature <= 0)
        try:
            row = self.lanes.get(key).admit(g.prompt_ids, g.params)
        except ValueError as exc:  # the request itself is at fault (the engine is fine)
            with self.cond:
                self.admitting.remove(job)
            job.send("error", ApiError(400, str(exc)))
            self.metrics.finished("error")
            return
        with self.cond:
            self.admitting.remove(job)
            self.joining[(key, row)] = job

    def _prefill(self) -> None:
        """Joining prompts into their rows, first come first served, a chunk at a time: while requests
        are running, at most `prefill_budget` prompt tokens (but at least one chunk) between two rounds,
        so a long prompt delays the running requests' next tokens by about one chunk, not its whole
        prefill; with nothing running, every joining prompt goes in at once."""
        spent = 0
        for (key, row), job in list(self.joining.items()):
            while (key, row) in self.joining and not job.cancelled:  # a cancelled one is freed at the next boundary
                if self.running and self.prefill_budget is not None and spent >= self.prefill_budget:
                    return
                spent += self._prefill_chunk(key, row, job)

    def _prefill_chunk(self, key, row: int, job: Job) -> int:
        """One chunk of a joining request's prompt -> tokens it took; after the last, its first token."""
        g = job.gen
        try:
            done = self.lanes.get(key).prefill(row)
        except NonFiniteLogits as exc:  # this request's numbers overflowed; the others go on
            with self.cond:
                del self.joining[(key, row)]
            job.send("error", ApiError(500, str(exc)))
            self.metrics.finished("error")
            return 0
        if done.first is None:
            return done.tokens
        self.metrics.admitted(len(g.prompt_ids))
        job.send("tokens", [done.first])
        with self.cond:
            del self.joining[(key, row)]
            if done.live:
                self.running[(key, row)] = job
        if not done.live:
            self._finish(job, [done.first])
        return done.tokens

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
        self.metrics.gauges(len(self.waiting), len(self.running) + len(self.joining) + len(self.admitting))

    def _die(self, exc: Exception) -> None:
        first = (str(exc).strip().splitlines() or [""])[0]
        msg = f"the engine failed ({type(exc).__name__}: {first}); the server is stopping"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        with self.cond:
            self.dead = msg
            jobs = list(self.running.values()) + list(self.joining.values()) + self.admitting + list(self.waiting)
            self.running.clear()
            self.joining.clear()
            self.admitting.clear()
            self.waiting.clear()
            self._gauges()
        for job in jobs:
            job.send("error", ApiError(503, msg))
            self.metrics.finished("error")
        if self.on_fatal is not None:
            self.on_fatal(msg)
