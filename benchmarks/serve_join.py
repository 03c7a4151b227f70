"""Join stall of `kdtree serve`: a running stream's inter-token gaps while a long prompt joins its batch.

In process (the server's Scheduler over LocalLanes, as `kdtree serve` runs them; no HTTP): one greedy
request streams MAX_TOKENS tokens; once it has its first few, a LONG-token prompt joins the batch.  For
each prefill budget (whole prompts at once, the scheduler before chunked prefill; one chunk per round
boundary, `kdtree serve`'s default) it records the stream's gaps between token events while the long
prompt joins (from its submit to its first token) and outside that window, the rounds the stream got
during the join, the long prompt's time to first token, and both requests' tokens.

    python -m benchmarks.serve_join [--model DIR] [--drafter DIR] [--spec none|chain|ddtree]
                                    [--long 3800] [--max-model-len 4096] [--max-tokens 64]

Without --model a tiny random checkpoint (build_pipeline.tiny) is written to a temporary folder.
Writes benchmarks/results/serve-join-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

import torch

from benchmarks.common import print_table, write_result
from benchmarks.serve_load import model_dir
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.engine.engine import Engine
from runtime.serve.lanes import LocalLanes
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import Generation
from runtime.serve.scheduler import Job, Scheduler

SHORT = [5, 6, 7, 8]  # the running stream's prompt


def _generation(engine: Engine, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...]) -> Generation:
    params = SamplingParams(max_tokens, 0.0, 0, stop_ids)
    return Generation(prompt, params, SpecConfig(engine.spec, engine.budget), (), chat=False, stream=True,
                      include_usage=False, return_token_ids=True, model="bench")


async def read_events(job: Job, times: list[float]) -> list[int]:
    """A job's tokens until it is done; the time of each token event into `times`."""
    tokens: list[int] = []
    while True:
        kind, payload = await job.events.get()
        if kind == "tokens":
            times.append(time.perf_counter())
            tokens += payload
        elif kind == "done":
            return tokens
        else:
            raise payload


def join_stall(engine: Engine, long_prompt: list[int], budget: int | None, max_model_len: int,
               max_tokens: int = 64, stop_ids: tuple[int, ...] = (), wait_events: int = 3) -> dict:
    """One stream of `max_tokens` runs; after its first `wait_events` token events `long_prompt` joins
    (max 4 new tokens).  budget: the scheduler's prefill_budget (None: whole prompts at once)."""
    lanes = LocalLanes(engine, 2, max_model_len)
    sched = Scheduler(lanes, 2, 2, Metrics("bench"), prefill_budget=budget).start()
    stream_t: list[float] = []
    long_t: list[float] = []

    async def scenario() -> tuple[list[int], list[int], float]:
        loop = asyncio.get_running_loop()
        stream = Job(_generation(engine, SHORT, max_tokens, stop_ids), loop)
        sched.submit(stream)
        reading = asyncio.create_task(read_events(stream, stream_t))
        while len(stream_t) < wait_events and not reading.done():
            await asyncio.sleep(0.0005)
        joined = time.perf_counter()
        long_job = Job(_generation(engine, long_prompt, 4, stop_ids), loop)
        sched.submit(long_job)
        long_tokens = await read_events(long_job, long_t)
        return await reading, long_tokens, joined

    try:
        stream_tokens, long_tokens, joined = asyncio.run(scenario())
    finally:
        sched.close()
        lanes.close()
    first = long_t[0]
    gaps = [(b - a, a, b) for a, b in zip(stream_t, stream_t[1:])]
    during = [g for g, a, b in gaps if b > joined and a < first]  # gaps overlapping the join
    outside = [g for g, a, b in gaps if not (b > joined and a < first)]
    return {"budget": "whole prompt" if budget is None else budget, "long_prompt": len(long_prompt),
            "stream_tokens": len(stream_tokens),
            "max_gap_ms_during_join": round(1e3 * max(during), 2) if during else None,
            "median_gap_ms_outside": round(1e3 * statistics.median(outside), 2) if outside else None,
            "stream_rounds_during_join": sum(1 for t in stream_t if joined < t < first),
            "long_ttft_s": round(first - joined, 3),
            "tokens": {"stream": stream_tokens, "long": long_tokens}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--long", type=int, default=3800, help="tokens of the joining prompt")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens of the running stream")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000) for _ in range(a.long)]
    with model_dir(a.model) as model:
        engine = Engine.load(model, device=a.device, drafter=a.drafter, spec=a.spec)
        join_stall(engine, long_prompt[:64], None, a.max_model_len, 8)  # warm-up
        rows = [join_stall(engine, long_prompt, budget, a.max_model_len, a.max_tokens) for budget in (None, 256)]
        spec = engine.spec
        engine.close()
    same = rows[0]["tokens"] == rows[1]["tokens"]
    for r in rows:
        r.pop("tokens")
    print_table(rows, ["budget", "long_prompt", "max_gap_ms_during_join", "median_gap_ms_outside",
                       "stream_rounds_during_join", "long_ttft_s"])
    path = write_result(f"serve-join-{a.device}", rows, {
        "model": "tiny random kimi (build_pipeline.tiny)" if a.model is None else a.model, "spec": spec,
        "max_model_len": a.max_model_len, "max_tokens": a.max_tokens, "same_tokens": same,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}, a.out)
    print(f"same tokens both ways: {same}; wrote {path}")
    return 0 if same else 1

if __name__ == "__main__":
    sys.exit(main())
