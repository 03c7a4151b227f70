"""Engine and the static round on CPU: lossless against AR, a reused engine equal to a fresh one,
streaming text equal to `kdtree run`, the counter-based sampler, `kdtree bench --json`."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from agreeing_drafter import AgreeingDrafter
from build_pipeline.tiny_drafter import make_tiny_drafter
from decoding import decode, load_pair
from plugins.common.rng import choose
from runtime import Engine
from runtime.cli import app
from runtime.decode.params import SamplingParams

NEW = 24


class Setup:
    """fp64 'small' target + DFlash drafter, three prompts (one longer than an ingest chunk, so the
    drafter takes the prompt in several calls), a stop token that cuts some requests short."""

    def __init__(self, tiny, tmp):
        self.path = tiny.get("small")
        self.drafter_dir = tmp / "dr"
        make_tiny_drafter(self.path, self.drafter_dir)
        m = load_pair(self.path, self.drafter_dir)
        self.target, self.dflash = m.target, m.drafter
        rng = random.Random(1)
        self.prompts = [[rng.randrange(1000) for _ in range(n)] for n in (3, 11, 270)]
        free, _ = decode(self.target, None, self.prompts, SamplingParams(NEW))
        self.stop = free[1][NEW // 2]
        self.params = SamplingParams(NEW, stop_ids=(self.stop,))
        self.ar, _ = decode(self.target, None, self.prompts, self.params)
        assert any(len(o) < NEW for o in self.ar)


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    return Setup(tiny, tmp_path_factory.mktemp("engine"))


def _engine(s: Setup, drafter, spec: str, budget: int) -> Engine:
    return Engine.from_models(s.target, drafter, None, spec, budget, graphs=False)


@pytest.mark.parametrize("drafter,spec,budget", [("agreeing", "chain", 0), ("agreeing", "ddtree", 4),
                                                 ("agreeing", "ddtree", 16), ("dflash", "ddtree", 16),
                                                 ("none", "none", 0)])
def test_reused_engine_equals_fresh_and_ar(setup, drafter, spec, budget):
    s = setup
    d = {"agreeing": lambda: AgreeingDrafter(s.target, miss_prob=0.3, seed=budget), "dflash": lambda: s.dflash,
         "none": lambda: None}[drafter]()
    eng = _engine(s, d, spec, budget or 16)
    out = eng.generate_batch_ids(s.prompts, NEW, stop=[s.stop])
    assert out == s.ar, [(r, o, a) for r, (o, a) in enumerate(zip(out, s.ar)) if o != a]
    again = eng.generate_batch_ids(s.prompts, NEW, stop=[s.stop])  # the session (buffers, caches) reused
    assert again == out
    st = eng.last_stats
    assert st["new_tokens"] == sum(map(len, s.ar)) and st["graphs"] is False
    if drafter == "agreeing":
        assert st["tau"] > 2.0, st  # multi-token acceptance is exercised
    one = list(eng.generate_ids(s.prompts[2], NEW, stop=[s.stop]))  # batch of 1 == its row of the batch
    assert one == s.ar[2]


def test_edge_cases_max_new_tokens_and_first_token_stop(setup):
    s = setup
    eng = _engine(s, s.dflash, "ddtree", 4)
    assert list(eng.generate_ids(s.prompts[0], 0)) == []
    assert list(eng.generate_ids(s.prompts[0], 1)) == s.ar[0][:1]
    first = s.ar[0][0]
    assert list(eng.generate_ids(s.prompts[0], NEW, stop=[first])) == [first]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(eng.generate_ids([10 ** 6], 4))
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine.from_models(s.target, None, None, "ddtree", 4, graphs=False)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        list(eng.generate_ids(s.prompts[0], -1))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        list(eng.generate_ids(s.prompts[0], 4, temperature=-1.0))


def test_sampling_is_seeded_and_reproducible(setup):
    s = setup
    eng = _engine(s, s.dflash, "ddtree", 4)
    a = list(eng.generate_ids(s.prompts[1], 12, temperature=0.9, seed=5))
    b = list(eng.generate_ids(s.prompts[1], 12, temperature=0.9, seed=5))
    c = list(eng.generate_ids(s.prompts[1], 12, temperature=0.9, seed=6))
    assert a == b and len(a) == 12 and a != c
    # a batch: request r draws from its own (seed + r, counter) row, so it samples what it samples alone
    batch = eng.generate_batch_ids(s.prompts, 12, temperature=0.9, seed=5)
    assert batch == [list(eng.generate_ids(p, 12, temperature=0.9, seed=5 + r)) for r, p in enumerate(s.prompts)]
    assert batch[1] == c  # prompts[1] in row 1: seed 6


def test_counter_sampler_matches_softmax():
    """choose() at T > 0 over 20000 independent rows of one logit vector: chi-square vs softmax."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 20000
    rng = torch.tensor([[7, 0]], dtype=torch.int64)  # one request of `rows` rows
    inv_t = torch.tensor([1 / 0.8])
    draws = choose(logits.expand(1, rows, -1), False, rng, inv_t)[0]  # [rows]
    assert rng.tolist() == [[7, 1]]  # the counter advanced once
    probs = torch.softmax(logits / 0.8, -1).double()
    observed = torch.bincount(draws, minlength=6).tolist()
    expected = (probs * rows).tolist()
    expected[-1] = rows - sum(expected[:-1])  # sums must agree exactly
    assert chisquare(observed, expected).pvalue > 1e-3
    again = choose(logits.expand(1, rows, -1), False, torch.tensor([[7, 0]]), inv_t)[0]
    assert torch.equal(draws, again)


def test_generate_streams_the_text_of_kdtree_run(tiny):
    path = tiny.get("kimi")
    eng = Engine.load(path)  # fp32, AR: what `kdtree run` uses by default
    pieces = list(eng.generate("Hello world", max_new_tokens=12))
    r = CliRunner().invoke(app, ["run", path, "--prompt", "Hello world", "--max-new-tokens", "12", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert "".join(pieces) == out["text"] and len(pieces) >= 2
    ids = eng.encode("Hello world")
    assert out["token_ids"] == decode(eng.runner.target, None, [ids],
                                      SamplingParams(12, stop_ids=eng.stop_ids()[0]))[0][0]
    r = CliRunner().invoke(app, ["run", path, "--prompt", "Hello world", "--max-new-tokens", "12"])
    assert r.exit_code == 0 and r.stdout.rstrip("\n") == out["text"]
    assert eng.last_stats["graphs"] is False  # CPU: eager


def test_stop_string_cuts_the_text(tiny):
    eng = Engine.load(tiny.get("kimi"))
    full = "".join(eng.generate("Hello world", max_new_tokens=16))
    needle = full[len(full) // 2: len(full) // 2 + 2]
    cut = "".join(eng.generate("Hello world", max_new_tokens=16, stop=[needle]))
    assert cut == full[:full.find(needle)]


def test_bench_json_on_cpu(setup, tmp_path):
    s = setup
    r = CliRunner().invoke(app, ["bench", s.path, "--drafter", str(s.drafter_dir), "--budgets", "2",
                                 "--max-new-tokens", "4", "--json", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert [row["mode"] for row in res["rows"]] == ["none", "chain", "ddtree-2"]
    for row in res["rows"]:
        for key in ("decode_tokens_per_s", "tau", "rounds", "wall_us_per_round", "host_us_per_round",
                    "gpu_us_per_round", "gpu_idle_frac", "stage_us_per_round", "graphs", "matches_ar"):
            assert key in row, key
        assert row["graphs"] is False and set(row["stage_us_per_round"]) == {"draft", "build", "verify", "accept",
                                                                            "commit"}
    assert res["summary"]["all_match_ar"] and (tmp_path / "bench-small-hf.json").is_file()
    r = CliRunner().invoke(app, ["bench", s.path, "--budgets", "x"])
    assert r.exit_code == 1 and "--budgets" in r.stderr


def test_engine_and_run_load_a_built_artifact(tiny, tmp_path, monkeypatch):
    """`kdtree build` output (with the drafter inside) decodes like the checkpoint dir."""
    build = pytest.importorskip("build_pipeline.build")
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    path = tiny.get("kimi")
    make_tiny_drafter(path, tmp_path / "dr")
    art = build.build(path, out=tmp_path / "art", drafter_dir=tmp_path / "dr", archs="none", progress=False).art_dir
    eng = Engine.load(art)
    assert eng.spec == "ddtree" and eng.tokenizer is not None  # drafter and tokenizer come from the artifact
    want = list(Engine.load(path).generate_ids("Hello world", 10))
    assert list(eng.generate_ids("Hello world", 10)) == want
    r = CliRunner().invoke(app, ["run", str(art), "--prompt", "Hello world", "--max-new-tokens", "10", "--spec",
                                 "ddtree", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == want


def test_run_build_takes_a_checkpoint_dir_through_the_cache(tiny, tmp_path, monkeypatch):
    """`kdtree run MODEL_DIR --build`: built once into KDTREE_CACHE, then a cache hit; same tokens."""
    pytest.importorskip("build_pipeline.build")
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    path = tiny.get("kimi")
    args = ["run", str(path), "--prompt", "Hello world", "--max-new-tokens", "6", "--json"]
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0, plain.output
    for _ in range(2):  # first call builds, second finds the entry
        r = CliRunner().invoke(app, args + ["--build"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    entries = [p for p in (tmp_path / "cache").rglob("manifest.json")]
    assert len(entries) == 1, entries
