"""Server metrics in Prometheus' text exposition format (version 0.0.4), written by hand.

Counters and sums are updated by the scheduler's thread; a scrape reads them under the same lock.
tau (tokens per round per request, bonus included) is exported as its two counters
(accepted tokens, request-rounds) and as their ratio.
"""

from __future__ import annotations

import threading
from collections import Counter

ROUND_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, model: str):
        self.model = model
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # finished requests by outcome: stop, length, cancelled, error
        self.prompt_tokens = self.generation_tokens = 0
        self.rounds = self.request_rounds = self.accepted_tokens = 0
        self.round_seconds = 0.0
        self.round_buckets = [0] * len(ROUND_BUCKETS_S)
        self.queue_depth = self.running = 0  # gauges, set by the scheduler

    def finished(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += 1  # the first token comes out of the prefill

    def round(self, seconds: float, accept_lens: list[int], tokens: int) -> None:
        """One step of one slot batch: its wall time, each live row's accepted length, tokens emitted."""
        with self.lock:
            self.rounds += 1
            self.round_seconds += seconds
            for i, le in enumerate(ROUND_BUCKETS_S):
                if seconds <= le:
                    self.round_buckets[i] += 1
            self.request_rounds += sum(1 for a in accept_lens if a > 0)
            self.accepted_tokens += sum(accept_lens)
            self.generation_tokens += tokens

    def gauges(self, queue_depth: int, running: int) -> None:
        with self.lock:
            self.queue_depth, self.running = queue_depth, running

    def render(self) -> str:
        m = f'model="{self.model}"'
        with self.lock:
            lines = [
                "# HELP kdtree_requests_total Finished requests by outcome.", "# TYPE kdtree_requests_total counter"]
            for outcome in sorted(set(self.requests) | {"stop", "length"}):
                lines.append(f'kdtree_requests_total{{{m},outcome="{outcome}"}} {self.requests[outcome]}')
            tau = self.accepted_tokens / self.request_rounds if self.request_rounds else 0.0
            for name, kind, text, value in (
                    ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
                    ("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
                    ("accepted_tokens_total", "counter", "Tokens accepted by verification, bonus included.",
                     self.accepted_tokens),
                    ("request_rounds_total", "counter", "Rounds times the requests live in them.",
                     self.request_rounds),
                    ("tau", "gauge", "Mean tokens per round per request (accepted_tokens / request_rounds).", tau),
                    ("queue_depth", "gauge", "Requests waiting for a slot.", self.queue_depth),
                    ("running", "gauge", "Requests holding a slot.", self.running)):
                lines += [f"# HELP kdtree_{name} {text}", f"# TYPE kdtree_{name} {kind}",
                          f"kdtree_{name}{{{m}}} {value}"]
            lines += ["# HELP kdtree_round_seconds Wall time of one decode round of a slot batch.",
                      "# TYPE kdtree_round_seconds histogram"]
            for le, count in zip(ROUND_BUCKETS_S, self.round_buckets):
                lines.append(f'kdtree_round_seconds_bucket{{{m},le="{le}"}} {count}')
            lines += [f'kdtree_round_seconds_bucket{{{m},le="+Inf"}} {self.rounds}',
                      f"kdtree_round_seconds_sum{{{m}}} {self.round_seconds:.6f}",
                      f"kdtree_round_seconds_count{{{m}}} {self.rounds}"]
        return "\n".join(lines) + "\n"
