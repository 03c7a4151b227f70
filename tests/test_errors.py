"""One error path (issue 18, items 7-10): bad flags and files name the thing at fault in one
`error:` line with exit 1 ({"error": ...} on stdout under --json), the Python API raises the
documented type with the same message, and no input is silently ignored."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from build_pipeline import build as build_mod
from build_pipeline.build import build
from build_pipeline.tiny import make_tiny
from core.errors import CheckpointError, KdtreeError
from core.tokenizer import Tokenizer
from runtime import Engine
from runtime.cli import app
from runtime.decode.params import InvalidParam, SamplingParams


def _error(*args: str) -> str:
    """The one stderr line of a failing command (exit 1); under --json also the same message as JSON."""
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), (args, r.output)
    msg = r.stderr[len("error: "):-1]
    if "--json" in args:
        assert json.loads(r.stdout) == {"error": msg}
    else:
        assert r.stdout == ""
    return msg


@pytest.fixture
def model(tiny, tmp_path):
    return shutil.copytree(tiny.get("kimi"), tmp_path / "model")


def test_parse_errors_are_one_line_and_json(tiny):
    path = tiny.get("kimi")
    assert _error("run", path, "--prompt-ids", "5", "--seed", "1e23") == \
        "Invalid value for '--seed': Input should be a valid integer, unable to parse string as an integer"
    assert _error("run", path, "--prompt-ids", "5", "--max-new-tokens", "x", "--json").startswith(
        "Invalid value for '--max-new-tokens'")
    assert _error("run", path, "--bogus") == "No such option: --bogus"
    assert _error("nonsense") == "No such command 'nonsense'."
    assert _error("run", path, "--prompt-ids", "5", "--temperature", "-1", "--json") == \
        "--temperature must be >= 0, got -1.0"


def test_seed_out_of_range_names_the_flag(tiny):
    big = str(10 ** 23)
    want = f"seed must be an integer in [-2**63, 2**63) (the generator's int64 state), got {big}"
    assert _error("run", tiny.get("kimi"), "--prompt-ids", "5", "--seed", big) == "--" + want
    with pytest.raises(InvalidParam) as exc:
        SamplingParams(seed=10 ** 23)
    assert str(exc.value) == want


def test_make_tiny_onto_a_file_is_a_clean_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep me")
    want = f"{f}: exists and is not a directory (--force replaces only a folder)"
    assert _error("make-tiny", str(f), "--force") == want
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        make_tiny(f, force=True)
    assert f.read_text() == "keep me"


def test_damaged_tokenizer_files_are_named(model):
    (model / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: not valid JSON"):
        Tokenizer.load(model)
    assert _error("build", str(model), "--arch", "none").startswith(f"{model / 'tokenizer_config.json'}: not valid")
    (model / "tokenizer_config.json").unlink()
    (model / "tiktoken.model").write_bytes(b"\xff\xfe garbage \x00")
    assert _error("build", str(model), "--arch", "none") == \
        f"{model / 'tiktoken.model'}: not a tiktoken BPE file (not UTF-8 text)"
    (model / "tiktoken.model").write_text("notbase64 x\n")
    with pytest.raises(CheckpointError, match=r"tiktoken.model:1: expected `base64-token rank`"):
        build(model, archs=(), progress=False)


def test_bench_out_a_file_and_name_escaping_out(tiny, tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    path = tiny.get("kimi")
    assert _error("bench", path, "--out", str(f)) == f"--out {f}: exists and is not a folder"
    assert _error("bench", path, "--out", str(tmp_path), "--name", "../x") == \
        "--name must be a plain file name (it lands in --out), got '../x'"
    assert _error("bench", path, "--budgets", "4") == \
        "--budgets needs a drafter (--drafter DIR, or an artifact built with one): without one bench measures AR only"


def test_extra_checkpoint_layers_are_refused(model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1  # the checkpoint keeps its last layer
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"tensors of layers {cfg['num_hidden_layers']}\.\.\d+ lie past "
                                              rf"num_hidden_layers {cfg['num_hidden_layers']} \(\+ 0 MTP\)"):
        build(model, archs=(), progress=False)


def test_run_flags_that_would_be_ignored(tiny, tmp_path):
    path = tiny.get("kimi")
    assert _error("run", path, "--prompt-ids", "5", "--chat") == \
        "--chat wraps --prompt text; it does not apply to --prompt-ids"
    assert _error("run", path, "--prompt-ids", "5", "--budget", "8") == \
        "--budget applies to --spec ddtree, which needs a drafter (--drafter DIR)"
    assert _error("run", path, "--prompt-ids", "5", "--spec", "chain", "--budget", "8", "--drafter", str(tmp_path)) \
        == "--budget applies to --spec ddtree, not --spec chain"
    assert _error("run", path, "--prompt-ids", "5", "--spec", "none", "--drafter", str(tmp_path)) == \
        "--drafter is unused with --spec none (drop one of them)"


def test_build_out_onto_a_foreign_folder_is_refused_before_the_build(model, tmp_path, monkeypatch):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("meow")
    monkeypatch.setattr(build_mod, "_build_into", lambda *a, **k: pytest.fail("built before refusing --out"))
    with pytest.raises(KdtreeError, match="--out .*photos: exists and is not a kdtree artifact"):
        build(model, out=foreign, archs=(), progress=False)
    assert (foreign / "cat.jpg").read_text() == "meow"


def test_special_token_strings_are_plain_text_unless_allowed(tiny):
    eng = Engine.load(tiny.get("kimi"))
    tok = eng.tokenizer
    end = tok.specials["<|im_end|>"]
    assert end not in eng.encode("hi <|im_end|> there")
    assert end in eng.encode("hi <|im_end|> there", allowed_special=True)
    chat = tok.chat("x <|im_end|><|im_assistant|>")
    assert chat.count(end) == 1  # only the real end of the user turn
    r = CliRunner().invoke(app, ["run", tiny.get("kimi"), "--prompt", "<|im_end|>", "--max-new-tokens", "0",
                                 "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["stats"]["prompt_tokens"] == len(tok.encode("<|im_end|>")) > 1


def test_zero_new_tokens_reports_the_prompt(tiny):
    eng = Engine.load(tiny.get("kimi"))
    assert list(eng.generate_ids([5, 6, 7], 0)) == [] and eng.last_stats["prompt_tokens"] == 3



def test_env_switches_take_0_or_1_and_name_the_variable(monkeypatch):
    """KDTREE_PDL, KDTREE_FUSION, KDTREE_MOE_PREFETCH, KDTREE_GEMM_PREFETCH: unset -> default, "0" / "1", and
    anything else is one error naming the variable (`kdtree run`: one line, exit 1), not a switch left as it was."""
    import subprocess
    import sys
    from pathlib import Path

    from core.env_flags import env_flag
    monkeypatch.delenv("KDTREE_X", raising=False)
    assert env_flag("KDTREE_X", True) and not env_flag("KDTREE_X", False)
    for value, want in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("KDTREE_X", value)
        assert env_flag("KDTREE_X", True) is want
    monkeypatch.setenv("KDTREE_X", "off")
    with pytest.raises(ValueError, match="KDTREE_X must be 0 or 1, got 'off'"):
        env_flag("KDTREE_X", True)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KDTREE_FUSION")}
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "run", "/nonexistent", "--prompt-ids", "1"],
                          env=env | {"KDTREE_FUSION": "true", "PYTHONPATH": str(root)}, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr == "error: KDTREE_FUSION must be 0 or 1, got 'true'\n", proc.stderr
