"""Per-stage timing of eager decode steps (a captured graph is timed as a whole by the session), and the
timing of back-to-back CUDA launches between two events (cost curves, benchmarks)."""

from __future__ import annotations

import contextlib
import time

import torch

from runtime.decode.stats import STAGES


def time_launches(launch, n: int) -> float:
    """µs per call of `launch` (a graph replay, usually) over n back-to-back calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        launch()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / n


@contextlib.contextmanager
def no_clock(stage: str):
    """The clock of a captured step: times nothing."""
    yield


class StageClock:
    """Per-stage time of eager calls: CUDA events on a CUDA device (no sync while running;
    `totals_s` syncs once), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.pairs: list[tuple[str, object, object]] = []
        self.cpu_s = {k: 0.0 for k in STAGES}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pairs.append((stage, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.cpu_s[stage] += time.perf_counter() - t0

    def totals_s(self) -> dict[str, float]:
        if not self.cuda:
            return dict(self.cpu_s)
        torch.cuda.synchronize()
        out = {k: 0.0 for k in STAGES}
        for stage, start, end in self.pairs:
            out[stage] += start.elapsed_time(end) / 1e3
        return out
