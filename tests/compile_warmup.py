"""Compile a GPU test's Triton kernel variants in parallel, before the test checks its shapes one by one.

Triton compiles a variant (constexprs, integer specialisations, dtypes) on first launch, on one CPU core; the
large tree_build and MoE variants take 5-70 s each, and a test over 200+ random shapes spent nearly all its
time there (runs cut off at 150 s had checked fewer than 10 shapes).  `warm` runs the test module as a script,
`python <module> --warm '<json list of cases>'`, in several processes that each launch their share of the
cases once (no reference, no checks), so the variants land in Triton's on-disk cache in parallel; the test
itself then loads them from the cache.  Each module picks one case per variant and groups the cases that share
an expensive kernel, so that no variant compiles in two processes at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def int_spec(v: int) -> int:
    """How Triton specialises an integer argument: 1 when it equals 1, 16 when divisible by 16, else 0."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def warm(script: Path, groups: list[list], costs: list[float], workers: int | None = None,
         timeout_s: float = 900.0) -> dict:
    """Launches `script --warm '<cases>'` in `workers` processes; the groups of cases (JSON-able; a group's
    cases run in one process) go costliest first to the least loaded process.  Raises RuntimeError with a
    worker's stderr tail when one fails.  Returns {"cases", "workers", "seconds"}."""
    t0 = time.time()
    workers = workers or max(1, min(len(groups), (os.cpu_count() or 2) - 1, 15))
    chunks: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for cost, group in sorted(zip(costs, groups), key=lambda cg: -cg[0]):
        w = load.index(min(load))
        chunks[w] += group
        load[w] += cost
    chunks = [c for c in chunks if c]
    env = dict(os.environ, PYTHONPATH=str(Path(script).resolve().parents[1]))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for w, chunk in enumerate(chunks):
            err = open(Path(tmp) / f"warm-{w}.err", "w+")  # a file, not a pipe: a full pipe would stall a worker
            procs.append((subprocess.Popen([sys.executable, str(script), "--warm", json.dumps(chunk)], env=env,
                                           stdout=subprocess.DEVNULL, stderr=err), err))
        failed = []
        for proc, err in procs:
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            err.seek(0)
            if rc != 0:
                failed.append(f"worker rc {rc}: {err.read()[-2000:]}")
            err.close()
    if failed:
        raise RuntimeError(f"compile warm-up of {script}: {len(failed)} of {len(chunks)} workers failed; "
                           f"first: {failed[0]}")
    return {"cases": sum(map(len, chunks)), "workers": len(chunks), "seconds": round(time.time() - t0, 1)}
