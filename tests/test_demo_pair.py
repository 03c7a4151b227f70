"""The bundled demo pair (artifacts/demo-pair): within its size limits, loads through the real loaders,
writes Python, and DDTree on it is lossless against AR at T = 0 with tau well above a random pair's ~1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "artifacts" / "demo-pair"
PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'


def test_sizes_and_license():
    target = sum(p.stat().st_size for p in (PAIR / "target").glob("*.safetensors"))
    drafter = sum(p.stat().st_size for p in (PAIR / "drafter").glob("*.safetensors"))
    assert target <= 25 * 2**20 and drafter <= 7 * 2**20, (target, drafter)
    assert "Python Software Foundation" in (PAIR / "LICENSE-corpus.txt").read_text()
    cfg = json.loads((PAIR / "target" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"  # compressed-tensors INT4 experts


@pytest.fixture(scope="module")
def engine():
    from runtime.engine.engine import Engine
    eng = Engine.load(PAIR / "target", device="cpu", drafter=PAIR / "drafter", spec="ddtree", budget=16)
    yield eng
    eng.close()


def test_ddtree_lossless_and_accepting(engine):
    ar = list(engine.configure(spec="none").generate_ids(PROMPT, max_new_tokens=24))
    e = engine.configure(spec="ddtree", budget=16)
    tree = list(e.generate_ids(PROMPT, max_new_tokens=24))
    assert tree == ar
    assert e.last_stats["tau"] > 1.5, e.last_stats
    text = engine.tokenizer.decode(tree)
    assert any(w in text for w in ("return", "if ", "def ", "path")), text  # Python, not noise


def test_drafter_for_another_target_is_said(tmp_path):
    """A drafter records its target's fingerprint (core/fingerprint.py); loaded for another target it
    still decodes losslessly, with a warning naming both fingerprints; a malformed record is refused."""
    import shutil
    import warnings

    from build_pipeline.tiny_drafter import make_tiny_drafter, target_fingerprint
    from core.errors import ConfigError
    from runtime.engine.engine import Engine
    from runtime.load.drafter import DrafterProvenanceWarning

    mine = json.loads((PAIR / "drafter" / "config.json").read_text())["dflash_config"]["target_fingerprint"]
    assert mine == target_fingerprint(PAIR / "target")
    tiny = make_tiny_drafter(PAIR / "target", tmp_path / "tiny-drafter")  # make-tiny records it too
    assert json.loads((tiny / "config.json").read_text())["dflash_config"]["target_fingerprint"] == mine
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterProvenanceWarning)
        Engine.load(PAIR / "target", device="cpu", drafter=tiny, spec="ddtree", budget=4).close()

    other = tmp_path / "other"
    shutil.copytree(PAIR / "drafter", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["dflash_config"]["target_fingerprint"] = "0123456789abcdef"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(DrafterProvenanceWarning, match=r"built for another target.*0123456789abcdef.*" + mine):
        eng = Engine.load(PAIR / "target", device="cpu", drafter=other, spec="ddtree", budget=4)
    ar = list(eng.configure(spec="none").generate_ids(PROMPT, max_new_tokens=8))
    assert list(eng.configure(spec="ddtree", budget=4).generate_ids(PROMPT, max_new_tokens=8)) == ar
    eng.close()

    cfg["dflash_config"]["target_fingerprint"] = "not-hex"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="target_fingerprint"):
        Engine.load(PAIR / "target", device="cpu", drafter=other, spec="ddtree", budget=4)


def test_budget_aligned_benchmark_runs(tmp_path, monkeypatch):
    """benchmarks/budget_aligned.py (tau at 2^k - 1 against 2^k nodes) on a short run: lossless, both budgets'
    rows, the file written."""
    import sys

    import benchmarks.budget_aligned as ba

    monkeypatch.setattr(sys, "argv", ["budget_aligned", "--ks", "2", "--prompts", "1", "--new", "12", "--out",
                                      str(tmp_path)])
    ba.main()
    doc = json.loads((tmp_path / "budget-aligned.json").read_text())
    assert doc["matches_ar"] and [(r["aligned_budget"], r["power_budget"]) for r in doc["rows"]] == [(3, 4)]
    assert all(r["aligned_tau"] >= 1 and r["power_tau"] >= 1 for r in doc["rows"])
