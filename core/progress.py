"""A small progress bar on stderr for long steps (loading, packing, compiling)."""

from __future__ import annotations

import sys
import time


class Progress:
    """`Progress(total, "loading")`, `.advance(k)`, `.close()`; redraws 10x/s on a terminal, every 5 s in logs."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = max(total, 1), desc, enabled
        self.done = 0
        self.start = self._last = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = 0.1 if self.tty else 5.0

    def advance(self, k: int = 1) -> None:
        self.done += k
        now = time.monotonic()
        if self.enabled and (now - self._last > self.interval or (self.tty and self.done >= self.total)):
            self._last = now
            self._draw(now, end="\r" if self.tty else "\n")

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic(), end="\n")
            self.enabled = False

    def _draw(self, now: float, end: str) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(24 * frac)
        elapsed = now - self.start
        sys.stderr.write(f"{self.desc:<18} [{bar:<24}] {self.done}/{self.total} {elapsed:6.1f}s{end}")
        sys.stderr.flush()
