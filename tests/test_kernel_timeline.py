"""runtime/kernel_timeline.step_increments: what each kernel adds to a step, from start / end stamps."""

import random

import pytest

from runtime.kernel_timeline import step_increments


def test_serial_kernels_add_their_durations_and_gaps():
    spans = [(0.0, 4.0), (5.0, 7.0), (7.0, 10.0)]  # a 1-unit launch gap before the second
    assert step_increments(spans) == [(4.0, 0.0), (3.0, 1.0), (3.0, 0.0)]


def test_overlapped_kernel_adds_only_past_its_predecessor():
    # PDL: the second starts at 2 and waits for the first (ends 6), then runs to 8: it adds 2, not its 6
    assert step_increments([(2.0, 8.0), (0.0, 6.0)]) == [(2.0, 0.0), (6.0, 0.0)]
    # one ending inside an earlier kernel adds nothing
    assert step_increments([(0.0, 10.0), (1.0, 3.0), (4.0, 12.0)]) == [(10.0, 0.0), (0.0, 0.0), (2.0, 0.0)]


def test_increments_sum_to_the_span():
    rng = random.Random(3)
    for _ in range(50):
        spans = []
        for _ in range(rng.randint(1, 30)):
            a = rng.uniform(0, 100)
            spans.append((a, a + rng.uniform(0, 20)))
        inc = step_increments(spans)
        span = max(e for _, e in spans) - min(s for s, _ in spans)
        assert sum(a for a, _ in inc) == pytest.approx(span)
        assert all(0 <= idle <= a for a, idle in inc)


def test_bad_span_names_its_index():
    with pytest.raises(ValueError, match="span 1"):
        step_increments([(0.0, 1.0), (3.0, 2.0)])
