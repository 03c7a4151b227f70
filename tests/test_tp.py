"""Tensor / expert parallelism on CPU with gloo: --tp 2 and --tp 4 give the tokens of --tp 1.

Computed in float64: TP changes the summation order (per-rank partial sums, then the all-reduce), so
in fp32 a near-tied argmax could flip; the check here is that the parallel plan and the collectives
are right, which float64 shows without that noise (as the lossless tests in test_spec.py do).

Processes are spawned once per world size for the whole matrix (AR and DDTree, bf16 and INT4
experts, TP-sliced and EP experts); the `--tp 1` reference runs in this process, unsharded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from build_pipeline.tiny_drafter import make_tiny_drafter
from rank_jobs import Job, generate_on_rank, run_job
from runtime.parallel.comm import Comm
from runtime.parallel.ranks import RankFailure, launch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ((5, 6, 7, 8), (100, 200, 3))
NEW = 12
CLI_PROMPT = (11, 12, 13)


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_RANK_THREADS", "1")  # tiny matmuls: one thread per rank, no spinning
        for k in ("KDTREE_FAULT_RANK", "KDTREE_FAULT_KIND", "KDTREE_FAULT_AT"):
            mp.delenv(k, raising=False)
        yield


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory, env):
    """The 'kimi' preset: 4 heads, 16 experts, vocab 1024: divisible by 2 and 4."""
    tmp = tmp_path_factory.mktemp("tp-drafters")
    out = {}
    for int4 in (False, True):
        path = tiny.get("kimi", int4=int4)
        drafter = tmp / f"drafter-{int4}"
        make_tiny_drafter(path, drafter)
        out[int4] = (path, str(drafter))
    return out


def _jobs(models, tp: int) -> dict[str, Job]:
    bf16, int4 = models[False], models[True]
    jobs = {}
    for name, (path, drafter), ep in (("bf16", bf16, False), ("int4", int4, tp == 4), ("bf16-ep", bf16, True)):
        if name == "bf16-ep" and tp == 4:
            continue  # tp 4 already runs INT4 under EP; keep CI short
        # TP-sliced INT4 experts need (moe_intermediate_size / tp) % group_size == 0: 64 / 4 = 16 < 32,
        # so --tp 4 runs the INT4 model expert-parallel (core/plan.py refuses the TP cut)
        jobs[f"{name}-ar"] = Job(path, PROMPTS, NEW, ep=ep)
        jobs[f"{name}-ddtree"] = Job(path, PROMPTS, NEW, spec="ddtree", budget=8, drafter=drafter, ep=ep)
    return jobs


@pytest.fixture(scope="module")
def artifact(models, tmp_path_factory, env):
    """A `kdtree build --tp 2` artifact of the INT4 model (each rank then reads only its own shard)."""
    from build_pipeline.build import build

    tmp = tmp_path_factory.mktemp("tp-art")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_CACHE", str(tmp / "cache"))
        path, drafter = models[True]
        return str(build(path, out=tmp / "art", drafter_dir=drafter, tp=2, progress=False).art_dir)


@pytest.fixture(scope="module")
def runs(models, artifact, env):
    """{tp: {job name: per-rank outputs}} for tp 2 and 4, and the one-process reference per job."""
    by_tp = {tp: _jobs(models, tp) for tp in (2, 4)}
    for mode in ("ar", "ddtree"):  # the artifact's reference: the INT4 model dir, unsharded
        by_tp[2][f"art-int4-{mode}"] = dataclasses.replace(by_tp[2][f"int4-{mode}"], path=artifact)
    cli = Job(models[False][0], (CLI_PROMPT,), 8, spec="ddtree", budget=16, drafter=models[False][1])
    unique = {j for jobs in by_tp.values() for j in jobs.values() if j.path != artifact} | {cli}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the `--tp 1` reference: this process, the whole model, no collectives
        ref = {job: run_job(job, None) for job in unique}
    finally:
        torch.set_num_threads(threads)
    out = {}
    for tp, jobs in by_tp.items():
        names = list(jobs)
        per_rank = launch(generate_on_rank, tp, ([jobs[n] for n in names],))  # [rank][job][prompt]
        out[tp] = {n: ([per_rank[r][i] for r in range(tp)], ref[_unsharded(jobs[n], models)])
                   for i, n in enumerate(names)}
    return {"tp": out, "cli": ref[cli][0]}


def _unsharded(job: Job, models) -> Job:
    """The reference job of `job`: an artifact's model dir in its place."""
    return job if job.path in (models[False][0], models[True][0]) else dataclasses.replace(job, path=models[True][0])


@pytest.mark.parametrize("tp,name", [(2, n) for n in ("bf16-ar", "bf16-ddtree", "int4-ar", "int4-ddtree",
                                                      "bf16-ep-ar", "bf16-ep-ddtree", "art-int4-ar",
                                                      "art-int4-ddtree")]
                         + [(4, n) for n in ("bf16-ar", "bf16-ddtree", "int4-ar", "int4-ddtree")])
def test_tp_tokens_equal_one_rank(runs, tp, name):
    ranks, ref = runs["tp"][tp][name]
    assert all(len(o) == NEW for o in ref)
    for r, out in enumerate(ranks):
        assert out == ref, f"--tp {tp} {name}: rank {r} differs from --tp 1"


@pytest.mark.parametrize("ep", [False, True], ids=["tp-sliced", "ep"])
def test_cli_tp2_matches_tp1(models, runs, ep):
    path, drafter = models[False]
    res = _cli("run", path, "--prompt-ids", ",".join(map(str, CLI_PROMPT)), "--max-new-tokens", "8", "--spec",
               "ddtree", "--drafter", drafter, "--dtype", "float64", "--tp", "2", *(["--ep"] if ep else []), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["token_ids"] == runs["cli"]
    assert doc["stats"]["tp"] == 2 and doc["stats"]["plan"] == ("--tp 2 --ep" if ep else "--tp 2")


def _ping(comm: Comm, rounds: int) -> float:
    """A worker doing `rounds` all-reduces (the fault hooks count them)."""
    t = torch.ones(4, dtype=torch.float64)
    for _ in range(rounds):
        comm.all_reduce(t)
        t /= comm.world
    return float(t.sum())


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.mark.parametrize("kind,expect", [("raise", "rank 1 failed:.*injected failure on rank 1"),
                                         ("start", "rank 1 failed:.*injected start-up failure on rank 1")])
def test_failed_rank_is_named_and_all_stop(env, monkeypatch, kind, expect):
    monkeypatch.setenv("KDTREE_FAULT_RANK", "1")
    monkeypatch.setenv("KDTREE_FAULT_KIND", kind)
    monkeypatch.setenv("KDTREE_FAULT_AT", "5")
    with pytest.raises(RankFailure, match=f"(?s){expect}") as info:
        launch(_ping, 2, (50,))
    assert info.value.rank == 1
    assert len(info.value.pids) == 2 and _gone(info.value.pids)


def test_cli_rank_crash_mid_run(models, env):
    """`kdtree run --tp 2` with rank 1 crashing mid-decode: one clear error line naming rank 1, exit 1,
    and no process of the run left (found by a tag in their environment)."""
    path, _ = models[False]
    tag = uuid.uuid4().hex
    res = _cli("run", path, "--prompt-ids", "5,6,7", "--max-new-tokens", "8", "--dtype", "float64", "--tp", "2",
               extra_env={"KDTREE_FAULT_RANK": "1", "KDTREE_FAULT_AT": "30", "KDTREE_TEST_TAG": tag})
    assert res.returncode == 1
    assert "error: rank 1 died (exit code 3) before finishing" in res.stderr, res.stderr
    deadline = time.monotonic() + 10  # the forkserver exits on its own once its parent is gone
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _tagged(tag)


def _tagged(tag: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"KDTREE_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _cli(*args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "runtime.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
