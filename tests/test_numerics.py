"""Non-finite numbers never become output (issue 18, item 2): NaN / Inf weights refused at build
(naming the tensor), a non-positive rms_norm_eps refused with the config, and a NaN / Inf in a
round's logits stops the run with an error naming the round (AR, DDTree, sampling)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from build_pipeline.build import build
from build_pipeline.tiny_drafter import make_tiny_drafter
from core.errors import CheckpointError, ConfigError, NonFiniteLogits
from runtime import Engine
from runtime.cli import app


@pytest.fixture
def model(tiny, tmp_path):
    return shutil.copytree(tiny.get("kimi"), tmp_path / "model")


def _plant(model_dir, name: str, value: float) -> None:
    """Write `value` into element 0 of checkpoint tensor `name` (its shard rewritten, no pickle)."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = model_dir / index[name]
    tensors = load_file(shard)
    tensors[name].view(-1)[0] = value
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("name,value", [("model.layers.1.self_attn.o_proj.weight", float("nan")),
                                        ("lm_head.weight", float("inf"))])
def test_build_refuses_non_finite_weights(model, name, value):
    _plant(model, name, value)
    want = f"{model}: weight {name!r} \\(.*\\) holds 1 non-finite value\\(s\\) \\(NaN or Inf\\); refusing to build"
    with pytest.raises(CheckpointError, match=want):
        build(model, archs=(), progress=False)
    r = CliRunner().invoke(app, ["run", str(model), "--prompt-ids", "5,6"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "non-finite value(s)" in r.stderr


@pytest.mark.parametrize("eps", [-1, 0, "NaN"])
def test_non_positive_rms_norm_eps_is_refused(model, eps):
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = eps
    (model / "config.json").write_text(json.dumps(cfg).replace('"NaN"', "NaN"))
    with pytest.raises(ConfigError, match="`rms_norm_eps` must be a positive number, got"):
        build(model, archs=(), progress=False)
    r = CliRunner().invoke(app, ["run", str(model), "--prompt-ids", "5,6"])
    assert r.exit_code == 1 and r.stderr.startswith("error: config.json: `rms_norm_eps` must be a positive number")


@pytest.fixture(scope="module")
def engines(tiny, tmp_path_factory):
    """A tiny target with its DFlash drafter (weights poisoned in memory, past the build's check)."""
    path = tiny.get("kimi")
    drafter = tmp_path_factory.mktemp("nf") / "dr"
    make_tiny_drafter(path, drafter)
    return Engine.load(path, drafter=drafter, spec="ddtree", budget=4)


@pytest.mark.parametrize("spec,temperature", [("none", 0.0), ("ddtree", 0.0), ("ddtree", 0.8), ("none", 0.8)])
def test_non_finite_logits_stop_the_run(engines, spec, temperature):
    eng = engines.configure(spec=spec)
    ok = list(eng.generate_ids([5, 6, 7], 6, temperature, seed=1))
    assert len(ok) == 6
    head = eng.runner.target.w.lm_head
    saved = head[7].clone()
    try:
        head[7] = float("inf")  # the logit of token 7 becomes +-inf or NaN
        with pytest.raises(NonFiniteLogits, match=r"non-finite logits \(NaN or Inf\) in the prefill of request 0"):
            list(eng.generate_ids([5, 6, 7], 6, temperature, seed=1))
    finally:
        head[7] = saved
    o = eng.runner.target.w.layers[1].attn.o
    saved = o.clone()
    try:
        got = []
        with pytest.raises(NonFiniteLogits, match=r"non-finite logits \(NaN or Inf\) in decode round 1 of request 0"):
            for t in eng.generate_ids([5, 6, 7], 6, temperature, seed=1):
                got.append(t)
                if len(got) == 1:  # poisoned after the first token: a decode round meets it
                    o.fill_(float("nan"))
        assert got == ok[:1]
    finally:
        o.copy_(saved)
    assert list(eng.generate_ids([5, 6, 7], 6, temperature, seed=1)) == ok  # intact again

