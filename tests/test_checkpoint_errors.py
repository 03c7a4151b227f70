"""Bad checkpoints fail with one line naming the file or tensor, exit code 1, and no output."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app


@pytest.fixture()
def ckpt(tiny, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny.get("kimi"), dst)
    return dst


def _run(path: Path):
    result = CliRunner().invoke(app, ["run", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"])
    return result


def _assert_one_line_error(result, *needles):
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert json.loads(result.stdout) == {"error": err[len("error: "):]}  # _run passes --json


def _shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


EMBED = "model.embed_tokens.weight"
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


def test_truncated_shard(ckpt):
    shard = _shard_of(ckpt, KV_B)
    shard.write_bytes(shard.read_bytes()[:-64])
    _assert_one_line_error(_run(ckpt), shard.name, "truncated")


def test_header_length_past_end_of_file(ckpt):
    shard = _shard_of(ckpt, KV_B)
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    _assert_one_line_error(_run(ckpt), shard.name, "header length")


def test_offsets_out_of_range(ckpt):
    shard = _shard_of(ckpt, KV_B)

    def edit(h):
        b, e = h[KV_B]["data_offsets"]
        h[KV_B]["data_offsets"] = [b + 10**6, e + 10**6]

    _rewrite_header(shard, edit)
    _assert_one_line_error(_run(ckpt), shard.name, KV_B, "out of range")


def test_overlapping_offsets(ckpt):
    shard = _shard_of(ckpt, KV_B)

    def edit(h):
        names = [k for k in h if k != "__metadata__"]
        a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
        span = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        start = h[a]["data_offsets"][1] - 2
        h[b]["data_offsets"] = [start, start + span]

    _rewrite_header(shard, edit)
    _assert_one_line_error(_run(ckpt), shard.name, "overlap")


def test_unknown_dtype(ckpt):
    shard = _shard_of(ckpt, KV_B)
    _rewrite_header(shard, lambda h: h[KV_B].update(dtype="Q4_K"))
    _assert_one_line_error(_run(ckpt), shard.name, KV_B, "unknown dtype")


def test_shape_mismatch_against_config(ckpt):
    shard = _shard_of(ckpt, KV_B)
    _rewrite_header(shard, lambda h: h[KV_B].update(shape=list(reversed(h[KV_B]["shape"]))))
    _assert_one_line_error(_run(ckpt), KV_B, "config implies")


def test_missing_tensors_are_named(ckpt):
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][KV_B]
    index.write_text(json.dumps(data))
    _assert_one_line_error(_run(ckpt), "missing", KV_B)


def test_index_points_at_missing_shard(ckpt):
    shard = _shard_of(ckpt, KV_B)
    shard.unlink()
    _assert_one_line_error(_run(ckpt), "missing shard", shard.name)


def test_unsupported_config_value(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(_run(ckpt), "config.json", "hidden_act")


def test_tensor_not_in_its_shard(ckpt):
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    other = next(f for f in set(data["weight_map"].values()) if f != data["weight_map"][KV_B])
    data["weight_map"][KV_B] = other
    index.write_text(json.dumps(data))
    _assert_one_line_error(_run(ckpt), KV_B, other)


def test_checkpoint_code_is_never_run(ckpt):
    """auto_map points at remote code: a planted module must not be imported."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "modeling_evil.py").write_text("raise SystemExit('checkpoint code ran')\n")
    (ckpt / "tokenization_kimi.py").write_text("raise SystemExit('checkpoint code ran')\n")
    result = _run(ckpt)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 2
