"""The demo-pair recipe (training/, issue 19) on a toy corpus and the TINY recipe: corpus split and
determinism, tokenizer, loss going down, resume == uninterrupted, the exports loading through the real
loaders, the trainable drafter agreeing with the runtime's, and DDTree at T=0 giving AR's tokens."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from training.corpus import build_corpus, is_held_out, read_split
from training.recipe import DEMO, TINY

FILES = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "heapq.py", "textwrap.py", "abc.py",
         "argparse.py", "base64.py", "calendar.py", "cmd.py", "contextlib.py", "copy.py", "enum.py", "functools.py"]
STEPS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A small stdlib look-alike: real stdlib files, a duplicate, a held-out module's test, a non-UTF-8 file."""
    src, dst = Path(sysconfig.get_paths()["stdlib"]), tmp_path_factory.mktemp("stdlib")
    for rel in FILES:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, dst / rel)
    (dst / "abc_copy.py").write_text((src / "abc.py").read_text().replace("\n", "   \r\n"))  # same normalised
    (dst / "test").mkdir()
    (dst / "test" / "test_json.py").write_text("import json\nassert json.loads('1') == 1\n")
    (dst / "latin.py").write_bytes(b"# caf\xe9\n")
    (dst / "site-packages").mkdir()
    (dst / "site-packages" / "x.py").write_text("x = 1\n")
    return dst


def test_corpus_is_deterministic_and_holds_out(root, tmp_path):
    a, b = build_corpus(tmp_path / "a", root), build_corpus(tmp_path / "b", root)
    assert a == b and a["sha256"] == b["sha256"]
    train = [p for p, _ in read_split(tmp_path / "a", "train")]
    held = [p for p, _ in read_split(tmp_path / "a", "eval")]
    assert held == ["heapq.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "test/test_json.py",
                    "textwrap.py"]
    assert train == sorted(train) and not any(is_held_out(p) for p in train)
    assert "abc.py" in train and "abc_copy.py" not in train  # duplicate after normalisation
    assert "latin.py" not in train and not any(p.startswith("site-packages") for p in train)
    assert "PSF" in (tmp_path / "a" / "LICENSE-corpus.txt").read_text()


def test_tokenizer_roundtrip_and_markers(root, tmp_path):
    from core.tokenizer import CHAT_MARKERS, Tokenizer
    from training.tokenizer import SPECIALS, train_tokenizer

    build_corpus(tmp_path / "c", root)
    texts = [t for _, t in read_split(tmp_path / "c", "train")]
    for d in ("t1", "t2"):
        train_tokenizer(texts, 1024, tmp_path / d)
    assert (tmp_path / "t1" / "tokenizer.json").read_bytes() == (tmp_path / "t2" / "tokenizer.json").read_bytes()
    tok = Tokenizer.load(tmp_path / "t1")
    assert tok.vocab_size == 1024 and tok.bos_id == 1024 - len(SPECIALS) and tok.eos_id == tok.bos_id + 1
    for text in ["def f(x):\n    return x ** 2  # é ✓ 漢字\n", "\t\r\n  ", texts[0][:2000]]:
        assert tok.decode(tok.encode(text)) == text
    for m in CHAT_MARKERS + ("[MASK]",):
        assert tok.encode(m, allowed_special=True) == [tok.specials[m]]
        assert len(tok.encode(m)) > 1  # plain text unless allowed
    assert tok.chat("hi")[0] == tok.specials["<|im_user|>"]


def test_budget():
    DEMO.check_budget()
    assert DEMO.target_bytes() <= 25_000_000 and DEMO.drafter_bytes() <= 7_000_000
    with pytest.raises(ValueError, match="over budget"):
        DEMO.with_(hidden=512).check_budget()


def _run(out: Path, root: Path, stop_at: int | None = None, stop_at_phase: str | None = None) -> dict:
    from training.pipeline import train_demo

    return train_demo(out, TINY, STEPS, STEPS, corpus_root=root, ckpt_every=3, eval_every=4, eval_windows=4,
                      stop_at=stop_at, measure=False, progress=False, log=lambda s: None,
                      stop_at_phase=stop_at_phase)


@pytest.fixture(scope="module")
def runs(root, tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    full = _run(base / "full", root)
    _run(base / "resumed", root, stop_at=5)  # interrupted mid-target (after a checkpoint at 3, one at 5)
    resumed = _run(base / "resumed", root)
    _run(base / "split", root, stop_at_phase="target")  # the target phase on one machine ...
    shutil.rmtree(base / "split" / "ckpt")  # ... its optimiser state not carried to the next
    _run(base / "split", root)
    return base, full, resumed


def test_loss_goes_down_and_resume_is_exact(runs):
    base, full, resumed = runs
    rows = [json.loads(line) for line in (base / "full" / "loss.jsonl").read_text().splitlines()]
    target = [r["loss"] for r in rows if r["phase"] == "target"]
    drafter = [r["loss"] for r in rows if r["phase"] == "drafter"]
    assert len(target) == len(drafter) == STEPS
    assert sum(target[-2:]) < sum(target[:2]) and sum(drafter[-2:]) < sum(drafter[:2])
    assert ((base / "full" / "loss.jsonl").read_text().count("\n")
            == (base / "resumed" / "loss.jsonl").read_text().count("\n"))
    for phase in ("target", "drafter"):
        a = torch.load(base / "full" / "ckpt" / f"{phase}.pt", weights_only=False)
        b = torch.load(base / "resumed" / "ckpt" / f"{phase}.pt", weights_only=False)
        assert a["step"] == b["step"] == STEPS
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert [r["loss"] for r in a["rows"]] == [r["loss"] for r in b["rows"]]
    assert full["target"] == resumed["target"]
    # the drafter trained in a later run on the target's export alone is the one trained in one go
    a = torch.load(base / "full" / "ckpt" / "drafter.pt", weights_only=False)
    b = torch.load(base / "split" / "ckpt" / "drafter.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    def losses(run: str) -> list:
        return [(r["phase"], r["step"], r["loss"]) for r in map(json.loads, (base / run / "loss.jsonl").open())]

    assert losses("full") == losses("split")
    assert abs(full["target"]["eval_loss_int4_shipped"] - full["target"]["eval_loss_trained"]) < 0.05


def test_exports_load_and_ddtree_is_lossless(runs):
    from core.config import load_config
    from runtime.engine.engine import Engine

    out = runs[0] / "full"
    cfg = load_config(out / "target")
    assert cfg.n_routed_experts == TINY.experts and cfg.q_lora_rank == TINY.q_lora and cfg.rope.kind == "yarn"
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    assert any(k.endswith("experts.0.gate_proj.weight_packed") for k in index["weight_map"])
    assert abs(index["metadata"]["total_size"] - TINY.target_bytes()) / TINY.target_bytes() < 0.02
    assert (out / "target" / "LICENSE-corpus.txt").is_file()
    prompt = read_split(out / "corpus", "eval")[0][1][:300]
    eng = Engine.load(out / "target", drafter=out / "drafter", spec="ddtree", budget=8)
    ar = list(eng.configure(spec="none").generate_ids(prompt, max_new_tokens=24))
    assert len(ar) > 0 and eng.tokenizer.decode(ar)
    for spec, budget in (("ddtree", 8), ("ddtree", 32), ("chain", 8)):
        assert list(eng.configure(spec=spec, budget=budget).generate_ids(prompt, max_new_tokens=24)) == ar


def test_trainable_drafter_matches_runtime(runs):
    """The training forward (k anchors in one pass, block-sparse mask) gives the runtime's draft logits."""
    from safetensors.torch import load_file

    from runtime.engine.engine import Engine
    from training.drafter import TrainableDrafter

    out = runs[0] / "full"
    eng = Engine.load(out / "target", drafter=out / "drafter", spec="ddtree", budget=8)
    target, rt = eng.runner.target, eng.runner.drafter
    config = json.loads((out / "drafter" / "config.json").read_text())
    tr = TrainableDrafter(config, target.cfg.hidden_size, seed=1)
    stored = load_file(str(out / "drafter" / "model.safetensors"))
    with torch.no_grad():
        for s in tr.specs:
            tr.w(s.key).copy_(stored[s.ckpt].float())
    g = torch.Generator().manual_seed(0)
    l, feat = 40, len(config["dflash_config"]["target_layer_ids"]) * target.cfg.hidden_size
    feats = torch.randn(1, l, feat, generator=g)
    ids = torch.randint(0, target.cfg.vocab_size - 16, (1, l), generator=g)
    anchors = torch.tensor([[3, 17, 30]])
    with torch.no_grad():
        got = tr(feats, ids, anchors, target.w.embed, target.w.lm_head)  # [1, 3, D, v]
        for j, p in enumerate(anchors[0].tolist()):
            cache = rt.new_cache(1, 64)
            want = rt.draft(cache, feats[:, :p], torch.tensor([p], dtype=torch.int32), ids[:, p])  # [1, D, v]
            torch.testing.assert_close(got[0, j], want[0], atol=2e-4, rtol=2e-4)
