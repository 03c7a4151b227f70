"""A damaged artifact never runs (issue 18, item 1): every file a load reads is checked against the
manifest's sha256 (hashed while read, or skipped through a mark while unchanged), manifest paths stay
inside the artifact, a damaged manifest is named as such."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from build_pipeline import integrity
from build_pipeline.build import build
from core.errors import CheckpointError
from runtime import Engine
from runtime.cli import app


@pytest.fixture
def art(tiny, tmp_path):
    """A private artifact (files get damaged in it)."""
    return build(tiny.get("kimi"), out=tmp_path / "art", archs=(), progress=False).art_dir


def _hashes(monkeypatch) -> list:
    calls: list = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: calls.append(p.name) or real(p))
    return calls


def _cli_error(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    return r.stderr.strip()


def test_a_flipped_byte_is_refused_on_load_and_marks_skip_unchanged_files(art, monkeypatch):
    calls = _hashes(monkeypatch)
    ids = list(Engine.load(art).generate_ids([5, 6, 7], 4))  # first load: every file hashed, then marked
    assert "layer.001.safetensors" in calls and "tiktoken.model" in calls
    calls.clear()
    assert list(Engine.load(art).generate_ids([5, 6, 7], 4)) == ids and calls == []  # unchanged: no re-read

    victim = art / "rank0" / "layer.001.safetensors"
    st = victim.stat()
    with open(victim, "r+b") as f:  # one bit of one weight, far from the header
        f.seek(st.st_size - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: the ctime still moved
    want = f"{victim}: sha256 differs from the manifest's (the file is corrupted or was modified; rebuild with " \
           f"`kdtree build --force`)"
    with pytest.raises(CheckpointError) as exc:
        Engine.load(art)
    assert str(exc.value) == want
    assert _cli_error("run", str(art), "--prompt-ids", "5,6,7") == f"error: {want}"


def test_overwritten_and_truncated_files_are_refused(art):
    victim = art / "rank0" / "globals.safetensors"
    data = bytearray(victim.read_bytes())
    data[-200_000 if len(data) > 400_000 else len(data) // 2:] = bytes(min(200_000, len(data) - len(data) // 2))
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="globals.safetensors: sha256 differs from the manifest's"):
        Engine.load(art)
    tok = art / "tokenizer" / "tiktoken.model"
    tok.write_bytes(tok.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"tiktoken.model: \d+ bytes, the manifest says \d+ \(truncated"):
        Engine.load(art)


def test_manifest_paths_stay_inside_the_artifact(art):
    manifest = json.loads((art / "manifest.json").read_text())
    entry = manifest["ranks"]["0"]["files"][0]
    entry["path"] = "../../etc/passwd"
    (art / "manifest.json").write_text(json.dumps(manifest))
    want = f"{art / 'manifest.json'}: lists the file '../../etc/passwd', outside the artifact; refusing to open it"
    with pytest.raises(CheckpointError) as exc:
        Engine.load(art)
    assert str(exc.value) == want
    assert _cli_error("run", str(art), "--prompt-ids", "5") == f"error: {want}"


def test_a_truncated_manifest_is_named(art):
    m = art / "manifest.json"
    m.write_text(m.read_text()[:100])
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable \(JSONDecodeError: the manifest is "
                                              r"truncated or corrupted"):
        Engine.load(art)
    assert "manifest is truncated" in _cli_error("run", str(art), "--prompt-ids", "5")


def test_build_key_covers_only_the_files_the_build_reads(tiny, tmp_path):
    model = shutil.copytree(tiny.get("kimi"), tmp_path / "model")
    first = build(model, archs=(), progress=False)
    (model / "notes.txt").write_text("not read by the build")
    (model / "modeling_deepseek.py").write_text("raise SystemExit\n")
    again = build(model, archs=(), progress=False)
    assert again.cache_hit and again.manifest["key"] == first.manifest["key"]
    assert sorted(again.manifest["inputs"]) == sorted(
        ["model/config.json", "model/model.safetensors.index.json", "model/tiktoken.model",
         "model/tokenizer_config.json", "model/generation_config.json"]
        + [f"model/{p.name}" for p in model.glob("*.safetensors")])
    (model / "config.json").write_text((model / "config.json").read_text() + " ")  # a file it reads: a new key
    assert not build(model, archs=(), progress=False).cache_hit
