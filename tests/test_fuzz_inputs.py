"""CPU fuzz over damaged artifacts, damaged checkpoints and CLI flags (issue 18): a fixed seed, a
bounded number of cases and time.  Every case must end in exit 0 or in one `error:` line with exit
1, never a traceback; a damaged artifact or a non-finite checkpoint never exits 0; nothing outside
the case's own folder (and the build cache) is written."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from build_pipeline.build import build
from runtime.cli import app

SEED, CASES, BUDGET_S = 18, 24, 90


def _run(args: list[str]):
    r = CliRunner().invoke(app, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    assert "Traceback" not in r.output, (args, r.output)
    assert r.exit_code in (0, 1), (args, r.exit_code, r.output)
    if r.exit_code == 1:
        assert r.stderr.strip().splitlines()[-1].startswith("error: ") and r.stderr.count("error: ") == 1, r.output
    return r


def _damage_artifact(rng: random.Random, art: Path) -> str:
    files = sorted(p for p in art.rglob("*") if p.is_file() and ".verified" not in p.parts
                   and p.suffix in (".safetensors", ".model", ".json") and p.parent.name != "graphs")
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    kind = rng.choice(["flip", "zero", "truncate", "path"] if victim.name == "manifest.json" else
                      ["flip", "zero", "truncate"])
    if kind == "flip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        i = rng.randrange(len(data))
        data[i:i + rng.randint(1, 200_000)] = bytes(len(data[i:i + 200_000]))
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    else:
        m = json.loads(data)
        m["ranks"]["0"]["files"][0]["path"] = rng.choice(["../../etc/passwd", "/etc/passwd", "rank0/../../x"])
        data = bytearray(json.dumps(m).encode())
    if bytes(data) == victim.read_bytes():  # e.g. zeroing zeros: force a change
        data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    return f"{kind} {victim.relative_to(art)}"


def _damage_checkpoint(rng: random.Random, model: Path) -> tuple[str, bool]:
    """(what, must_fail): a non-finite weight must fail; a config edit may be valid."""
    kind = rng.choice(["nan", "inf", "config", "delete"])
    if kind in ("nan", "inf"):
        shard = rng.choice(sorted(model.glob("*.safetensors")))
        tensors = load_file(shard)
        name = rng.choice(sorted(k for k, v in tensors.items() if v.is_floating_point()))
        t = tensors[name].view(-1)
        t[rng.randrange(t.numel())] = float(kind)
        save_file(tensors, shard, metadata={"format": "pt"})
        return f"{kind} in {name}", True
    if kind == "config":
        cfg = json.loads((model / "config.json").read_text())
        key = rng.choice(["rms_norm_eps", "vocab_size", "num_attention_heads", "num_hidden_layers", "hidden_size",
                          "max_position_embeddings", "n_routed_experts", "rope_theta"])
        cfg[key] = rng.choice([-1, 0, 0.5, 3, None, "x", [], 10 ** 12])
        (model / "config.json").write_text(json.dumps(cfg))
        return f"config {key}={cfg[key]!r}", False
    victim = rng.choice(sorted(p for p in model.iterdir() if p.is_file()))
    victim.unlink()
    return f"deleted {victim.name}", victim.suffix == ".safetensors" or victim.name == "config.json"


FLAGS = [("--seed", ["0", "-1", "1e23", str(2 ** 63), "x"]), ("--temperature", ["0", "0.7", "nan", "inf", "-1"]),
         ("--max-new-tokens", ["0", "1", "3", "-5", "10000000000"]), ("--budget", ["1", "0", "4", "x"]),
         ("--tp", ["0", "3", "-1"]), ("--spec", ["none", "ddtree", "beam"]), ("--dtype", ["float64", "int8"]),
         ("--device", ["cpu", "tpu"])]


@pytest.mark.parametrize("seed", [SEED])
def test_fuzz_bad_inputs(tiny, tmp_path, seed):
    rng = random.Random(seed)
    src = tiny.get("kimi")
    pristine = build(src, out=tmp_path / "pristine-art", archs=(), progress=False).art_dir
    outside = {p: p.stat().st_mtime_ns for p in Path(src).iterdir()}
    t0 = time.perf_counter()
    for case in range(CASES):
        if time.perf_counter() - t0 > BUDGET_S:
            break
        work = tmp_path / f"case{case}"
        kind = case % 3
        if kind == 0:
            art = shutil.copytree(pristine, work / "art")
            what = _damage_artifact(rng, art)
            r = _run(["run", str(art), "--prompt-ids", "5,6,7", "--max-new-tokens", "3"])
            assert r.exit_code == 1, (what, r.output)  # a damaged artifact never runs
        elif kind == 1:
            model = shutil.copytree(src, work / "model")
            what, must_fail = _damage_checkpoint(rng, model)
            r = _run(["run", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json"])
            if must_fail:
                assert r.exit_code == 1, (what, r.output)
        else:
            work.mkdir()
            picked = rng.sample(FLAGS, 3)
            args = [a for flag, values in picked for a in (flag, rng.choice(values))]
            _run(["run", src, "--prompt-ids", "5,6", *args])
    assert {p: p.stat().st_mtime_ns for p in Path(src).iterdir()} == outside  # the source is never written
    assert all(p.name == "pristine-art" or p.name.startswith("case") for p in tmp_path.iterdir())
