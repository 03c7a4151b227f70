"""Load test of `kdtree serve`: a fixed number of concurrent streaming clients for a fixed time, loopback only.

For each server setting (one request at a time: --max-batch 1; continuous batching: --max-batch
CLIENTS) it starts `kdtree serve` on a free port, runs CLIENTS clients that each send streaming
/v1/completions requests back to back (T = 0, random prompts as token ids, MAX_TOKENS each) until
SECONDS have passed, lets the requests in flight finish, and records per setting: requests done,
clean errors by status, hung requests (no byte for --stall-s: counted, never waited out), tokens/s
over the run, time to first token and latency percentiles, and the server's own /metrics (tau, rounds).

    python -m benchmarks.serve_load [--model DIR] [--drafter DIR] [--spec none|chain|ddtree]
                                    [--clients 8] [--seconds 20] [--max-tokens 32] [--device cpu|cuda]

Without --model a tiny random checkpoint (build_pipeline.tiny, the tests' model) is written to a
temporary folder.  Writes benchmarks/results/serve-load-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.common import print_table, write_result

ROOT = Path(__file__).resolve().parent.parent
URL = re.compile(r"on (http://127\.0\.0\.1:\d+)/v1")


class ServerProcess:
    """`kdtree serve ARGS --port 0` as a subprocess; wait() returns once it printed its URL."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", *args, "--port", "0"], cwd=ROOT,
                                     env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.base: str | None = None
        self._found = threading.Event()
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            m = URL.search(line)
            if m:
                self.base = m.group(1)
                self._found.set()

    def wait(self, timeout_s: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while not self._found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kdtree serve did not start:\n{''.join(self.out)}{''.join(self.err)}")
        return self

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=30)

    def metric(self, name: str) -> float:
        """A metric's value from /metrics (summed over its label sets)."""
        lines = self.get("/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))

    def wait_metric(self, name: str, value: float, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric(name) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed {self.metric(name)}, expected {value}")
            time.sleep(0.05)

    def exit_code(self, timeout_s: float = 30) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _one(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request -> {status, tokens, ttft_s, latency_s, error}."""
    t0 = time.monotonic()
    rec = {"status": None, "tokens": 0, "ttft_s": None, "latency_s": None, "error": None}
    try:
        async with http.stream("POST", url, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = json.loads(await r.aread())["error"]["message"]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec["latency_s"] = time.monotonic() - t0
                    return rec
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec["error"] = obj["error"]["message"]
                    return rec
                for c in obj["choices"]:
                    if c.get("token_ids") and rec["ttft_s"] is None:
                        rec["ttft_s"] = time.monotonic() - t0
                    rec["tokens"] += len(c.get("token_ids") or [])
            rec["error"] = "stream ended without [DONE]"
    except httpx.TimeoutException:
        rec["error"] = "hung"
    return rec


async def drive(base: str, clients: int, seconds: float, max_tokens: int, stall_s: float, seed: int = 0) -> dict:
    """CLIENTS streaming clients, back to back, for SECONDS; requests in flight at the end finish."""
    rng = random.Random(seed)
    records: list[dict] = []
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(stall_s)) as http:
            while time.monotonic() < deadline:
                prompt = [rng.randrange(1000) for _ in range(rng.randrange(4, 48))]
                records.append(await _one(http, base + "/v1/completions", {
                    "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "return_token_ids": True}))
                if records[-1]["status"] == 429:
                    await asyncio.sleep(0.05)

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.monotonic() - t0
    ok = [r for r in records if r["error"] is None]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"] is not None:
            key = "hung" if r["error"] == "hung" else str(r["status"])
            errors[key] = errors.get(key, 0) + 1
    lat = sorted(r["latency_s"] for r in ok)
    return {"requests": len(records), "completed": len(ok), "errors": errors, "hung": errors.get("hung", 0),
            "tokens": sum(r["tokens"] for r in records), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(r["tokens"] for r in records) / wall, 2),
            "ttft_s_mean": round(statistics.mean(r["ttft_s"] for r in ok), 4) if ok else None,
            "latency_s_p50": round(lat[len(lat) // 2], 4) if lat else None,
            "latency_s_p95": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 4) if lat else None}


def run_setting(model: str, extra: list[str], max_batch: int, clients: int, seconds: float, max_tokens: int,
                stall_s: float) -> dict:
    srv = ServerProcess(model, *extra, "--max-batch", str(max_batch), "--max-queue", str(clients)).wait()
    try:
        row = asyncio.run(drive(srv.base, clients, seconds, max_tokens, stall_s))
        row.update(max_batch=max_batch, tau=srv.metric("kdtree_tau"),
                   rounds=int(srv.metric("kdtree_round_seconds_count")),
                   round_ms_mean=round(1e3 * srv.metric("kdtree_round_seconds_sum") /
                                       max(srv.metric("kdtree_round_seconds_count"), 1), 3),
                   health=srv.get("/health").status_code)
    finally:
        srv.stop()
    return row


@contextmanager
def model_dir(model: str | None) -> Iterator[str]:
    """`model`, or (None) a tiny random checkpoint (build_pipeline.tiny, the tests' model) in a temporary
    folder that lasts the block."""
    if model is not None:
        yield model
        return
    from build_pipeline.tiny import make_tiny
    with tempfile.TemporaryDirectory() as tmp:
        yield str(make_tiny(Path(tmp) / "tiny-kimi", preset="kimi"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stall-s", type=float, default=120, help="a request silent this long counts as hung")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = ap.parse_args(argv)
    extra = ["--device", a.device, "--max-model-len", str(a.max_model_len)]
    extra += ["--drafter", a.drafter] if a.drafter else []
    extra += ["--spec", a.spec] if a.spec else []
    load_before = os.getloadavg()[0]  # this machine may be shared: say how busy it was
    with model_dir(a.model) as model:
        rows = [run_setting(model, extra, b, a.clients, a.seconds, a.max_tokens, a.stall_s) for b in (1, a.clients)]
    for r in rows:
        r["setting"] = "one at a time" if r["max_batch"] == 1 else "continuous batching"
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else None
    print_table(rows, ["setting", "max_batch", "requests", "completed", "errors", "tokens_per_s", "ttft_s_mean",
                       "latency_s_p50", "latency_s_p95", "round_ms_mean", "tau"])
    print(f"batching / one at a time: {speedup:.2f}x tokens/s")
    path = write_result(f"serve-load-{a.device}", rows, {
        "clients": a.clients, "seconds": a.seconds, "max_tokens": a.max_tokens, "max_model_len": a.max_model_len,
        "model": "tiny random kimi (build_pipeline.tiny)" if a.model is None else a.model, "spec": a.spec,
        "drafter": a.drafter, "cpu_count": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "speedup_tokens_per_s": round(speedup or 0, 3)}, a.out)
    print(f"wrote {path}")
    clean = all(r["hung"] == 0 and set(r["errors"]) <= {"429"} for r in rows)
    return 0 if clean and (speedup or 0) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
