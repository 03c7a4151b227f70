"""The one load path holds what the artifact stores, once: INT4 experts packed, no dequantised copy.

A rank's weights in memory (bf16 floats, INT4 experts int32 with their scales) must come to the
bytes of that rank's files in the artifact (build_pipeline/shard.py stores floats bf16 where exact):
a dequantised or duplicated expert copy would show as a multiple of them (at K2.6 TP8, ~250 GB a rank).
And `kdtree run --tp 2 --build` takes a checkpoint dir through the build cache like every other load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from build_pipeline.build import build
from core.plan import ParallelPlan
from runtime.load.artifact import is_artifact, read_manifest, read_rank
from runtime.load.models import load_models
from runtime.model.weights import MoEWeights, TargetWeights

ROOT = Path(__file__).resolve().parent.parent
PROMPT_IDS = "11,12,13"


@pytest.fixture(scope="module")
def k25(tiny) -> str:
    return tiny.get("kimi", int4=True, kimi25=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A module-wide KDTREE_CACHE for the loads here (the CLI test uses its own fresh one)."""
    root = tmp_path_factory.mktemp("kcache-load")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_CACHE", str(root))
        yield root


def _tensors(obj):
    """Every tensor reachable from a weights dataclass (lists and nested dataclasses followed)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def _held_bytes(w: TargetWeights) -> int:
    """Bytes of the unique storages behind the weights (a tied lm_head is the embed's storage)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(w)}
    return sum(storages.values())


def _file_bytes(manifest: dict, rank: int) -> int:
    return sum(e["bytes"] for e in manifest["ranks"][str(rank)]["files"])


def _assert_experts_once(w: TargetWeights) -> None:
    """Every MoE layer's routed experts are INT4 packed (int32 + scales), with no float copy beside them."""
    moe = [lw.mlp for lw in w.layers if isinstance(lw.mlp, MoEWeights)]
    assert moe
    for m in moe:
        ex = m.experts
        assert ex.w13.dtype == torch.int32 and ex.w2.dtype == torch.int32
        assert ex.w13_scale is not None and ex.w2_scale is not None and ex.w13_scale.is_floating_point()
        dense = [t for t in _tensors(m) if t.is_floating_point() and t.dim() == 3 and t.shape[0] == ex.count
                 and t.data_ptr() not in (ex.w13_scale.data_ptr(), ex.w2_scale.data_ptr())]
        assert not dense, [tuple(t.shape) for t in dense]


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_rank_holds_its_experts_once(k25, cache_dir, tp):
    """Loaded bf16 on the CPU, each rank holds its rank files' bytes (within 5 %), experts packed once."""
    if tp == 1:  # the checkpoint dir through load_models: the build cache, then rank 0's files
        m = load_models(k25, dtype=torch.bfloat16)
        assert m.art_dir.parent == cache_dir and is_artifact(m.art_dir)
        ranks = [(read_manifest(m.art_dir), 0, m.target.w)]
    else:
        art = build(k25, tp=tp, archs=(), progress=False).art_dir
        assert read_manifest(art)["plan"] == ParallelPlan(tp=tp).to_dict()
        ranks = [(b.manifest, r, b.weights) for r in range(tp)
                 for b in [read_rank(art, r, "cpu", torch.bfloat16)]]
    for manifest, r, w in ranks:
        _assert_experts_once(w)
        held, files = _held_bytes(w), _file_bytes(manifest, r)
        assert abs(held - files) <= 0.05 * files, f"--tp {tp} rank {r}: holds {held} bytes, its files {files}"


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    env = dict(env, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "runtime.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


def _plans(root: Path) -> list[dict]:
    return sorted((read_manifest(p)["plan"] for p in root.iterdir() if p.is_dir() and is_artifact(p)),
                  key=lambda p: (p["tp"], p["ep"]))


def test_cli_run_tp2_build_goes_through_the_cache(k25, tmp_path, monkeypatch):
    """`kdtree run CKPT --tp 2 --build`: a fresh cache gets the --tp 2 entry and the tokens are --tp 1's
    (float64: TP's summation order cannot flip a near-tied argmax)."""
    root = tmp_path / "kcache"
    monkeypatch.setenv("KDTREE_CACHE", str(root))
    monkeypatch.setenv("KDTREE_RANK_THREADS", "1")  # tiny matmuls: one thread per rank (as tests/test_tp.py)
    for k in ("KDTREE_FAULT_RANK", "KDTREE_FAULT_KIND", "KDTREE_FAULT_AT"):
        monkeypatch.delenv(k, raising=False)
    args = ["run", k25, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "8", "--dtype", "float64", "--build",
            "--json"]
    tp2 = _cli(*args, "--tp", "2", env=dict(os.environ))
    assert tp2.returncode == 0, tp2.stderr
    assert _plans(root) == [{"tp": 2, "ep": False}]
    doc2 = json.loads(tp2.stdout.strip().splitlines()[-1])
    assert doc2["stats"]["tp"] == 2 and doc2["stats"]["plan"] == "--tp 2"
    tp1 = _cli(*args, env=dict(os.environ))
    assert tp1.returncode == 0, tp1.stderr
    doc1 = json.loads(tp1.stdout.strip().splitlines()[-1])
    assert doc2["token_ids"] == doc1["token_ids"] and len(doc1["token_ids"]) > 0
    assert _plans(root) == [{"tp": 1, "ep": False}, {"tp": 2, "ep": False}]


@pytest.mark.gpu
def test_cuda_load_allocates_the_rank_files_once(k25, cache_dir):
    """load_models on CUDA (bf16): the allocator grows by the rank files' bytes (within 5 %), so no
    dequantised expert copy and no second copy of any tensor reaches the device."""
    art = build(k25, tp=1, archs=(), progress=False).art_dir  # no drafter: the target's weights alone
    files = _file_bytes(read_manifest(art), 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    m = load_models(art, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    out = os.environ.get("KDTREE_RESULTS_DIR")
    if out:  # the device run's record (benchmarks/device_run.sh sets the folder)
        from core.provenance import git_commit

        Path(out, "load-memory-device-test.json").write_text(json.dumps({
            "what": "CUDA memory_allocated growth of load_models (bf16, INT4 experts) vs the rank files' bytes",
            "gpu": torch.cuda.get_device_name(), "commit": git_commit(), "artifact_bytes": files,
            "cuda_bytes": grown, "ratio": round(grown / files, 4)}, indent=1) + "\n")
    assert m.drafter is None and m.target.device.type == "cuda"
    _assert_experts_once(m.target.w)
    assert abs(grown - files) <= 0.05 * files, f"CUDA memory grew {grown} bytes, the rank files are {files}"
