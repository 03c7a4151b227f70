"""Bad input refused with one clear line (issue 18, first items): what a build carries from a model
dir, the model's context length, a NaN temperature."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from build_pipeline.build import TOKENIZER_FILES, build
from core.errors import KdtreeError
from runtime import Engine
from runtime.cli import app


@pytest.fixture
def model(tiny, tmp_path):
    """A private copy of the tiny 'kimi' checkpoint (files get planted in it)."""
    return shutil.copytree(tiny.get("kimi"), tmp_path / "model")


def test_build_carries_only_the_tokenizer_files(model, tmp_path):
    (model / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n")
    os.symlink(secret, model / "notes.txt")
    art = build(model, archs=(), progress=False).art_dir
    carried = sorted(p.name for p in (art / "tokenizer").iterdir())
    assert carried == sorted(n for n in TOKENIZER_FILES if (model / n).exists()) and "tiktoken.model" in carried
    assert not any("root:x" in p.read_text(errors="replace") for p in art.rglob("*") if p.is_file()
                   and p.suffix != ".safetensors")


def test_build_refuses_a_tokenizer_symlink_out_of_the_model_dir(model, tmp_path):
    outside = tmp_path / "elsewhere.model"
    shutil.move(model / "tiktoken.model", outside)
    os.symlink(outside, model / "tiktoken.model")
    with pytest.raises(KdtreeError, match=r"tiktoken.model: a symlink to .*elsewhere.model, outside the model"):
        build(model, archs=(), progress=False)
    r = CliRunner().invoke(app, ["build", str(model), "--arch", "none"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "outside the model directory" in r.stderr


def test_context_length_is_enforced_up_front(tiny):
    path = tiny.get("kimi")
    eng = Engine.load(path)
    limit = eng.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"prompt of {limit + 1} tokens does not fit the model's context length "
                                         f"{limit}"):
        list(eng.generate_ids([5] * (limit + 1), 1))
    with pytest.raises(ValueError, match=f"max_new_tokens {limit} \\+ prompt 3 tokens exceed the model's context "
                                         f"length {limit}"):
        list(eng.generate_ids([5, 6, 7], limit))
    assert len(list(eng.generate_ids([5, 6, 7], 2))) == 2  # within the limit: runs
    r = CliRunner().invoke(app, ["run", path, "--prompt-ids", "5,6,7", "--max-new-tokens", str(limit)])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"error: --max-new-tokens {limit} + prompt 3 tokens exceed the model's context "
                                f"length {limit} (max_position_embeddings)")


def test_nan_temperature_is_refused(tiny):
    path = tiny.get("kimi")
    r = CliRunner().invoke(app, ["run", path, "--prompt-ids", "5,6", "--temperature", "nan"])
    assert r.exit_code == 1 and r.stderr.strip() == "error: --temperature must be >= 0, got nan"
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):
        list(Engine.load(path).generate_ids([5, 6], 2, temperature=float("nan")))


def test_a_session_that_cannot_fit_is_refused_before_allocating(tiny, tmp_path):
    """Item 4: a budget whose tree (mask, logits, the reference's N x N table) or a capacity whose cache
    exceeds the memory the device has is one line naming the flag, at once (it used to allocate for
    ~80 s and end in a MemoryError traceback)."""
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from runtime.decode.memory import check_fits, session_bytes
    from runtime.decode.params import InvalidParam

    path = tiny.get("kimi")
    drafter = make_tiny_drafter(path, tmp_path / "dr")
    r = CliRunner().invoke(app, ["run", path, "--drafter", str(drafter), "--spec", "ddtree", "--budget", "100000",
                                 "--prompt-ids", "5,6,7", "--max-new-tokens", "4"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]  # (progress bars aside)
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith("error: --budget 100000 needs ~") and "GB of memory are available" in errors[0]
    eng = Engine.load(path, drafter=drafter, spec="ddtree", budget=16)
    parts = session_bytes(eng.runner.target, eng.runner.drafter, 1, 4000, 17, 8, 256)
    assert parts["cache"] > 0 and parts["tree"] > 0
    with pytest.raises(InvalidParam, match=r"prompt \+ max_new_tokens \(4000 tokens per request\) need ~") as exc:
        check_fits(parts, eng.device, 16, 4000, available=parts["cache"] // 2)
    assert exc.value.name == "max_new_tokens"
    check_fits(parts, eng.device, 16, 4000, available=10 * sum(parts.values()))  # fits: no error
    assert len(list(eng.generate_ids([5, 6, 7], 4))) == 4
