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
