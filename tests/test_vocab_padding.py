"""A vocabulary the TP degree does not divide is padded like vLLM's vocab-parallel embedding, not
refused (issue 18, item 6): vocab 777 over 2 ranks gives the tokens of one rank, AR and DDTree; a
--tp that does not divide the heads is refused before any rank process starts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from build_pipeline.tiny_drafter import make_tiny_drafter
from core.errors import ConfigError
from runtime import Engine
from runtime.cli import app

VOCAB = 777


@pytest.fixture(scope="module")
def odd(tiny, tmp_path_factory):
    """The tiny 'kimi' checkpoint cut to a 777-token vocabulary (ids only: no tokenizer), and a drafter."""
    root = tmp_path_factory.mktemp("vocab777")
    path = shutil.copytree(tiny.get("kimi"), root / "model",
                           ignore=shutil.ignore_patterns("tiktoken.model", "tokenizer*"))
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        cut = {k for k in tensors if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
        if cut:
            save_file({k: v[:VOCAB].contiguous() if k in cut else v for k, v in tensors.items()}, shard,
                      metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(vocab_size=VOCAB, bos_token_id=700, eos_token_id=701, pad_token_id=702)
    (path / "config.json").write_text(json.dumps(cfg))
    make_tiny_drafter(path, root / "dr")
    return path, root / "dr"


def test_vocab_777_tp2_equals_tp1(odd, monkeypatch):
    monkeypatch.setenv("KDTREE_RANK_THREADS", "1")
    path, drafter = odd
    prompts = [[5, 6, 7, 8], [776, 3, 775]]  # the last ids of the vocabulary, on the padded rank
    want, got = {}, {}
    one = Engine.load(path, drafter=drafter, spec="ddtree", budget=4, dtype=torch.float64)
    for spec in ("none", "ddtree"):
        want[spec] = [list(one.configure(spec=spec).generate_ids(p, 10)) for p in prompts]
    for spec in ("none", "ddtree"):
        with Engine.load(path, drafter=drafter, spec=spec, budget=4, dtype=torch.float64, tp=2) as two:
            got[spec] = [list(two.generate_ids(p, 10)) for p in prompts]
            if spec == "none":
                sampled = list(two.generate_ids(prompts[0], 10, temperature=1.0, seed=3))
    assert got == want
    assert sampled == list(one.configure(spec="none").generate_ids(prompts[0], 10, temperature=1.0, seed=3))
    assert all(0 <= t < VOCAB for t in sampled)


def test_tp_not_dividing_heads_is_refused_before_ranks_start(tiny, monkeypatch):
    from runtime.engine import ranks

    def no_ranks(*a, **k):
        raise AssertionError("rank processes were started")

    monkeypatch.setattr(ranks, "RankGroup", no_ranks)
    path = tiny.get("kimi")  # 4 heads
    with pytest.raises(ConfigError, match="--tp 3: num_attention_heads 4 is not divisible by 3"):
        Engine.load(path, tp=3)
    r = CliRunner().invoke(app, ["run", path, "--prompt-ids", "5,6", "--tp", "3"])
    assert r.exit_code == 1 and r.stderr == "error: --tp 3: num_attention_heads 4 is not divisible by 3\n"
