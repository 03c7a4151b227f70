"""The kdtree CLI: run (text, ids, --json, --chat), inspect, make-tiny, and its argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from core.tokenizer import Tokenizer
from runtime.cli import app


def test_run_json_prompt_text_and_ids(tiny):
    path = tiny.get("kimi")
    r = CliRunner().invoke(app, ["run", path, "--prompt", "Hello world", "--max-new-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 8 and isinstance(out["text"], str)
    assert out["stats"]["new_tokens"] == 8 and out["stats"]["prompt_tokens"] == 2
    ids = Tokenizer.load(path).encode("Hello world")
    r2 = CliRunner().invoke(app, ["run", path, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "8",
                                  "--json"])
    assert json.loads(r2.stdout)["token_ids"] == out["token_ids"]


def test_run_chat_and_plain_text_output(tiny):
    r = CliRunner().invoke(app, ["run", tiny.get("kimi"), "--prompt", "Hi", "--chat", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "decode_tokens_per_s" in r.stderr


def test_run_argument_errors(tiny):
    path = tiny.get("kimi")
    for args, needle in [([], "exactly one of --prompt"), (["--prompt", "a", "--prompt-ids", "1"], "exactly one"),
                         (["--prompt-ids", "1,x"], "--prompt-ids"), (["--prompt-ids", "99999"], "outside"),
                         (["--prompt", "a", "--device", "tpu"], "--device"),
                         (["--prompt", "a", "--temperature", "-1"], "--temperature must be >= 0"),
                         (["--prompt", "a", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
                         (["--prompt", "a", "--spec", "ddtree", "--budget", "0", "--drafter", path],
                          "--budget must be >= 1")]:
        r = CliRunner().invoke(app, ["run", path, *args])
        assert r.exit_code == 1 and needle in r.stderr, (args, r.stderr)


def test_inspect_json(tiny):
    r = CliRunner().invoke(app, ["inspect", tiny.get("grouped"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["config"]["n_group"] == 4 and rep["total_params"] == sum(rep["params"].values())


def test_make_tiny_refuses_to_overwrite_and_console_script_runs(tmp_path):
    out = tmp_path / "m"
    r = CliRunner().invoke(app, ["make-tiny", str(out), "--preset", "kimi", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["make-tiny", str(out)])
    assert r.exit_code == 1 and "already exists" in r.stderr
    r = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "x"), "--preset", "nope"])
    assert r.exit_code == 1 and "--preset" in r.stderr and not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "inspect", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and "routed_experts" in proc.stdout


def test_run_speculative_modes_agree_with_ar(tiny, tmp_path):
    path = tiny.get("kimi")
    drafter = tmp_path / "dr"
    r = CliRunner().invoke(app, ["make-tiny", str(drafter), "--drafter-for", path, "--json"])
    assert r.exit_code == 0, r.output
    base = ["run", path, "--prompt", "Hello world", "--max-new-tokens", "12", "--json"]
    ar = json.loads(CliRunner().invoke(app, base).stdout)
    for spec in ("chain", "ddtree"):
        budget = ["--budget", "8"] if spec == "ddtree" else []  # a chain has no budget
        r = CliRunner().invoke(app, base + ["--drafter", str(drafter), "--spec", spec, *budget])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["token_ids"] == ar["token_ids"]
        assert out["stats"]["rounds"] >= 1 and set(out["stats"]["stage_ms"]) == {"draft", "build", "verify",
                                                                               "accept", "commit"}
    r = CliRunner().invoke(app, base + ["--spec", "ddtree"])
    assert r.exit_code == 1 and "--drafter" in r.stderr
    r = CliRunner().invoke(app, base + ["--drafter", str(drafter), "--spec", "beam"])
    assert r.exit_code == 1 and "--spec" in r.stderr


def test_bytecode_prefix_only_for_a_read_only_site_packages(tmp_path, monkeypatch):
    import os

    from runtime.cli import bytecode_prefix

    pkg = tmp_path / "torch"
    (pkg / "__pycache__").mkdir(parents=True)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert bytecode_prefix(pkg, env) is None  # writable: Python's own __pycache__
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(pkg)) else real_access(p, mode))
    assert bytecode_prefix(pkg, env) == str(tmp_path / "xdg" / "kdtree" / "pycache")
    assert bytecode_prefix(pkg, {**env, "PYTHONPYCACHEPREFIX": "/elsewhere"}) is None  # the user's choice stands
    assert bytecode_prefix(None, env) is None
    monkeypatch.setattr(sys, "pycache_prefix", "/set/by/-X")
    assert bytecode_prefix(pkg, env) is None
