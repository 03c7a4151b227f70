"""What each kernel of one replayed step adds to the step's time, from the profiler's start / end stamps.

Under programmatic dependent launch a kernel starts while its predecessor still runs and waits inside, so its
profiled duration counts time the step spends in the predecessor: the durations of a PDL round sum to far more than
the round (k26-rank.json, 2026-12-05: 8524 µs of kernels in a 4819 µs AR step).  On one stream kernels finish in
order, so the time a kernel adds is how far it moves the step's end: its end minus the latest end before it (0 if
it ends inside an earlier kernel).  Those increments sum to the span from the first start to the last end; `idle`
is the part of an increment spent with no kernel running (a launch gap before the kernel started).
"""

from __future__ import annotations


def step_increments(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """spans: (start, end) of each kernel, any order -> (added, idle) per kernel in the same order, in the spans'
    unit.  added: end - max(earlier ends, first start), >= 0; idle: max(0, start - earlier ends).  Kernels are taken in
    start order (ties by end); sum(added) = max(end) - min(start)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(spans)
    reach = min((s for s, _ in spans), default=0.0)  # the latest end so far (the first start before any)
    for i in order:
        start, end = spans[i]
        if end < start:
            raise ValueError(f"kernel span {i} ends before it starts: {spans[i]}")
        out[i] = (float(max(0.0, end - reach)), float(max(0.0, start - reach)))
        reach = max(reach, end)
    return out
