"""How a budget-auto session gets its cost curve (runtime/decode/budget.py): stored, else measured by itself.

`kdtree build` cannot time a GPU it does not run on, so the session measures T(b) the first time it
needs a curve for one way of running (replaying its captured graph, or eager rounds), with every
request frozen (runtime/decode/session.DecodeSession.frozen: nothing is committed, all state restored):

  R(b)  the whole round with the bucket forced to b (BucketChoice.force), for each bucket;
  C_j   the round with the tree built at cap j (BucketChoice.caps) and no bucket forced on (draft,
        tree_build at bucket j, the choice: no verify); C = C_j of the largest bucket; a bucket below
        the smallest cap (never built) takes that cap's;
  T(b)  = max(R(b) - C, 0), then made non-decreasing in b (T(b) = min over b' >= b of T(b'): a timing
        that a larger tree beats is noise, and a curve that dips would misplace the choice); C_j alike.

With graphs: replays of the captured round itself (REPLAYS per timing, between CUDA events), so T and C
are exactly what a replay costs.  Eager (the CPU reference, CUDA without graphs): one eager round per
timing, by the host clock (CUDA: synchronised).  Each is the fastest of REPS timings taken in turn over
the buckets, after a warm-up pass.
The cache holds what it holds at that moment (nothing, for a fresh session): attention's growth with
the context is not in T.

Stored: ART/autotune/<curve_name>/curve.json, written atomically by rank 0 when the artifact folder
is writable, else kept in memory (the note says why).  A stored curve without head_us (measured before
the caps) is measured again when the session has more than one cap.  Under tensor parallelism every rank must pick
the same bucket: rank 0 alone reads the file and broadcasts whether it had one, the ranks measure
together if not (their rounds hold collectives), and rank 0's curve is broadcast to every rank.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path
from typing import Callable

import torch

from runtime.decode.budget import CURVE_FILE, CostCurve, curve_name, device_label
from runtime.decode.clock import time_launches

REPS = 3  # timings per bucket after a warm-up one; the fastest counts
REPLAYS = 4  # replays per timing (CUDA graphs)


class SessionCurves:
    """A session's cost curves, one per way of running (graph replays, eager rounds), found once each."""

    def __init__(self, given: CostCurve | None, autotune_dir: str | Path | None):
        """given: the spec's curve (used for both ways); autotune_dir: ART/autotune, or None."""
        self.given, self.autotune_dir = given, autotune_dir
        self.found: dict[bool, tuple[CostCurve, str]] = {}  # graphs? -> (curve, where it came from)
        self.on: bool | None = None  # which one session.choice.cap_cost holds

    def use(self, session, graph) -> str:
        """Put the curve of running `session` through `graph` (a CapturedStep; None: eager) on the device:
        the given one, else a stored one, else measured now; returns where it came from."""
        way = graph is not None
        if way not in self.found:
            self.found[way] = (self.given, "given") if self.given is not None else session_curve(session, graph)
        if self.on != way:
            session.choice.set_curve(self.found[way][0])
            self.on = way
        return self.found[way][1]


def session_curve(session, graph) -> tuple[CostCurve, str]:
    """(the curve, where it came from) for `session` run through `graph` (a CapturedStep; None: eager).
    Every rank of a TP group must call it at the same point."""
    target, choice = session.target, session.choice
    comm = target.comm
    rank0 = comm is None or comm.rank == 0
    buckets = choice.buckets
    name = curve_name(target.device, target.dtype, graph is not None, session.batch, buckets[-1])
    folder = Path(session.curves.autotune_dir) / name if session.curves.autotune_dir is not None else None
    stored = None
    if rank0 and folder is not None and (folder / CURVE_FILE).is_file():
        stored = CostCurve.load(folder / CURVE_FILE)
        if not stored.head_us and len(choice.caps) > 1:
            stored = None  # measured before heads per cap existed: it would never cap the tree; measured again
    if _share(comm, [1.0 if stored is not None else 0.0], target.device)[0] > 0:
        where = str(folder / CURVE_FILE) if folder is not None else "rank 0's stored curve"
        verify, head = [0.0] * len(buckets), [0.0] * len(buckets)
        if stored is not None:
            verify, head = stored.verify_at(buckets, where), stored.head_at(buckets, where)
        values = _share(comm, verify + head, target.device)
        nb = len(buckets)
        return CostCurve(buckets, tuple(values[:nb]), values[-1], stored.source if stored else where,
                         tuple(values[nb:])), f"stored: {where}"
    verify, head = measure(session, graph)
    values = _share(comm, verify + head, target.device)  # rank 0's measurement on every rank
    how = "graph replays" if graph is not None else "eager rounds"
    nb = len(buckets)
    curve = CostCurve(buckets, tuple(values[:nb]), values[-1],
                      f"measured by the session: {device_label(target.device)}, {target.dtype}, {how}, "
                      f"batch {session.batch}, cache length {int(session.cache.lens.max())}, "
                      f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}", tuple(values[nb:]))
    if not rank0 or folder is None:
        return curve, "measured (kept in memory: no artifact folder)" if rank0 else "measured on rank 0"
    try:
        path = curve.save(folder)
    except OSError as exc:
        return curve, f"measured (kept in memory: {folder}: {exc.strerror or exc})"
    return curve, f"measured, stored: {path}"


def measure(session, graph) -> tuple[list[float], list[float]]:
    """(T(b) per bucket, C_j per bucket) in µs for `session` run through `graph` (None: eager); see the
    module doc.  The buckets and caps are timed in turn, REPS times over, and the fastest of each counts
    (noise from other work on the machine spreads over all of them instead of landing on one)."""
    choice, cuda = session.choice, session.cuda
    launch: Callable[[int], None] = graph.launch if graph is not None else (lambda cap: session.raw_step(True, cap=cap))
    nb = len(choice.buckets)
    full = nb - 1
    best = [math.inf] * nb  # R(b), the full tree built
    heads = {cap: math.inf for cap in choice.caps}  # C_j
    with session.frozen():
        for rep in range(REPS + 1):  # rep 0: warm-up (first calls, caches)
            for forced, cap in [(i, full) for i in range(nb)] + [(nb, cap) for cap in choice.caps]:
                choice.force.fill_(forced)  # nb: no bucket (the head alone)
                us = time_launches(lambda: launch(cap), REPLAYS) if graph is not None \
                    else _time_eager(lambda: launch(cap), cuda)
                if rep and forced < nb:
                    best[forced] = min(best[forced], us)
                elif rep:
                    heads[cap] = min(heads[cap], us)
    head = [heads.get(i, heads[choice.caps[0]]) for i in range(nb)]  # below the smallest cap: never built
    fixed = head[-1]
    verify = [max(r - fixed, 0.0) for r in best]
    for i in reversed(range(nb - 1)):  # a smaller tree costs no more than a larger one: drop the slow outliers
        verify[i] = min(verify[i], verify[i + 1])
        head[i] = min(head[i], head[i + 1])
    return verify, head


def _time_eager(launch: Callable[[], None], cuda: bool) -> float:
    """µs of one eager round (synchronised on CUDA)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    launch()
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0)


def _share(comm, values: list[float], device) -> list[float]:
    """Rank 0's `values` on every rank (unchanged without a group)."""
    if comm is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.broadcast(t, src=0)
    return t.tolist()
