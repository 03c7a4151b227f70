"""Budget per round (`--budget auto`, runtime/decode/budget.py) on the CPU reference path.

- tree_build is prefix-closed: the first b + 1 nodes of the tree of budget B are the tree of budget b
  (the reference op here; the Triton kernels under TRITON_INTERPRET=1 in test_tree_build_kernel.py),
  and its scores are the path log-probabilities, non-increasing;
- `choose` picks the argmax of E(b) / (T(b) + C) on hand-made scores and curves, live requests only;
- auto is lossless: tokens equal AR at T = 0 on the tiny model, batch 1 and 2, while the rounds verify
  more than one bucket; a session without a curve measures one, stores it, and the next one reads it;
- cost-curve JSON and budget-flag errors are one line naming the file and key (or the field).
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from plugins.common.bitmask import mask_words
from plugins.tree_build import build_from_topk_reference, topk_logprobs_reference, tree_build
from plugins.budget_choice import choose, expected_tokens, extra_tokens
from runtime.decode.budget import BucketChoice, CostCurve, CurveError, default_buckets
from runtime.decode.params import InvalidParam, SpecConfig, default_budget, parse_budget
from test_tree_build_kernel import check_prefix_closed

CURVE = CostCurve((1, 2, 4, 8, 16), (10.0, 12.0, 16.0, 24.0, 40.0), 60.0, "hand-made")
NEW = 24


def test_tree_build_is_prefix_closed_and_scores_are_path_logprobs():
    """The reference op (the Triton kernels: the interpreter cases of test_tree_build_kernel.py)."""
    gen = torch.Generator().manual_seed(0)
    for case, (b, depth, vocab, big) in enumerate([(2, 5, 60, 40), (1, 7, 30, 64), (3, 3, 200, 33)]):
        logits = torch.randn(b, depth, vocab, generator=gen) * (1.0 + case)
        if case == 2:
            logits = (logits * 2).round() / 2  # many exact ties
        assert not check_prefix_closed(logits, big, (1, 2, 3, 7, 16, big - 1), kernel=False), case
        n = big + 1
        outs = [torch.zeros(b, n, dtype=dt) for dt in (torch.int64, torch.int32, torch.int32, torch.int64)]
        outs.append(torch.zeros(b, n, mask_words(n), dtype=torch.int64))
        scores = torch.zeros(b, n)
        tree_build(logits, torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), big, *outs,
                   scores=scores)
        tokens, parents, dep = outs[:3]
        lp, ids = topk_logprobs_reference(logits, big)
        assert torch.equal(scores, build_from_topk_reference(lp, ids, big, torch.zeros(b), torch.zeros(b))[5])
        assert (scores[:, 0] == 0).all() and (scores[:, 2:] <= scores[:, 1:-1]).all()  # score order
        for r in range(b):  # a node's score is its parent's plus its own token's log-prob at its depth
            for i in range(1, n):
                d, p = int(dep[r, i]), int(parents[r, i])
                own = (logits[r, d - 1].double().log_softmax(-1)[tokens[r, i]]).item()
                assert math.isclose(scores[r, i].item(), scores[r, p].item() + own, abs_tol=1e-4)


def test_choose_is_the_argmax_of_expected_tokens_per_us():
    buckets = default_buckets(16)
    assert buckets == (1, 2, 4, 8, 16) and default_buckets(12) == (1, 2, 4, 8, 12) and default_buckets(1) == (1,)
    sizes = torch.tensor(buckets)
    rng = random.Random(0)
    for case in range(200):
        b = rng.randint(1, 3)
        probs = sorted((rng.random() ** rng.choice([1, 4, 12]) for _ in range(16)), reverse=True)
        scores = torch.tensor([[0.0] + [math.log(p * rng.uniform(0.5, 1.0)) for p in probs] for _ in range(b)])
        live = torch.tensor([rng.choice([0, 1, 1]) for _ in range(b)], dtype=torch.int32)
        t = sorted(rng.uniform(1, 100) for _ in buckets)
        c, scale = rng.choice([0.0, 10.0, 500.0]), rng.choice([1.0, 0.3, 2.5])
        cost = torch.tensor([x + c for x in t])
        e = [sum(live[r].item() * (1 + scale * scores[r, 1:k + 1].exp().sum().item()) for r in range(b))
             for k in buckets]
        rate = [ei / (ti + c) for ei, ti in zip(e, t)]
        torch.testing.assert_close(expected_tokens(scores, live, sizes, scale), torch.tensor(e), rtol=1e-5, atol=1e-5)
        got = int(choose(extra_tokens(scores, live, sizes), live, cost, scale))
        assert rate[got] >= max(rate) * (1 - 1e-5), (case, got, rate)
    # certain paths: E(b) = 1 + b per live request; cheap verify -> the largest bucket, dear -> the smallest
    sure = torch.zeros(2, 17)
    live = torch.tensor([1, 0], dtype=torch.int32)
    assert expected_tokens(sure, live, sizes).tolist() == [2.0, 3.0, 5.0, 9.0, 17.0]
    extra = extra_tokens(sure, live, sizes)
    assert int(choose(extra, live, torch.tensor([10.0, 10.5, 11, 12, 14]))) == 4
    assert int(choose(extra, live, torch.tensor([10.0, 20, 40, 80, 160]))) == 0  # a tie: the smaller
    assert int(choose(extra, live, torch.tensor([10.0, 14, 19, 40, 160]))) == 2
    assert int(choose(extra, live, torch.tensor([10.0, 14, 19, 40, 160]), 0.25)) == 0  # a doubtful drafter


def test_bucket_choice_force_and_one_hot():
    ch = BucketChoice(default_buckets(8), "cpu")
    ch.set_curve(CURVE)  # interpolated at 1, 2, 4, 8 from the same buckets: exact
    assert ch.cost_us.tolist() == [70.0, 72.0, 76.0, 84.0]
    scores, live = torch.zeros(1, 9), torch.ones(1, dtype=torch.int32)
    ch.select(scores, live)
    assert int(ch.pick) == 3 and ch.hot.tolist() == [False, False, False, True]
    ch.force.fill_(1)
    ch.select(scores, live)
    assert int(ch.pick) == 1 and ch.hot.tolist() == [False, True, False, False]
    ch.force.fill_(4)  # "none": no body runs (the measurement of C)
    ch.select(scores, live)
    assert not ch.hot.any()
    ch.force.fill_(-1)
    half = torch.full((1, 9), math.log(0.5))  # the drafter says 1/2 for every path: extra [0.5, 1, 2, 4]
    ch.select(half, live)
    assert int(ch.pick) == 3 and ch.extra.tolist() == [0.5, 1.0, 2.0, 4.0] and ch.scale().tolist() == [1.0] * 4
    path = torch.tensor([[0, 1, 2, 0, 0, 0, 0, 0]], dtype=torch.int32)  # accept_idx: root, node 1, node 2
    frozen = torch.tensor([0], dtype=torch.int32)
    ch.observe(frozen, path, 8)  # a frozen round measures nothing
    assert not ch.covered.any() and ch.seen.tolist() == [[1.0] * 4] * 2
    for _ in range(60):  # bucket 8 verified every round, two nodes accepted: buckets 1, 2 see all, 4, 8 half
        ch.force.fill_(3)
        ch.select(half, live)
        ch.observe(torch.tensor([3], dtype=torch.int32), path, 8)
    s = ch.scale().tolist()
    assert ch.covered.all() and abs(s[0] - 2) < 0.01 and abs(s[1] - 2) < 0.01 and abs(s[2] - 1) < 0.01 \
        and abs(s[3] - 0.5) < 0.01, s
    ch.force.fill_(-1)
    ch.select(half, live)  # E = 1 + s * extra = [2, 3, 3, 3] over [70, 72, 76, 84] µs: bucket 2 (one s: bucket 8)
    assert int(ch.pick) == 1


def test_a_bucket_never_verified_borrows_the_calibration_below():
    ch = BucketChoice(default_buckets(8), "cpu")
    ch.set_curve(CURVE)
    half, live = torch.full((1, 9), math.log(0.5)), torch.ones(1, dtype=torch.int32)
    path = torch.tensor([[0, 1, 2, 0, 0, 0, 0, 0]], dtype=torch.int32)
    for _ in range(60):  # only bucket 2 is ever verified; both its nodes are accepted: s -> 2 on buckets 1, 2
        ch.force.fill_(1)
        ch.select(half, live)
        ch.observe(torch.tensor([3], dtype=torch.int32), path, 2)
    assert ch.covered.tolist() == [True, True, False, False]
    s = ch.scale().tolist()
    assert all(abs(x - 2) < 0.01 for x in s), s  # 4 and 8 take bucket 2's


def test_caps_score_each_tree_size_and_hint_the_best():
    """A full round scores every cap j by the bucket it would pick under C_j; the hint is the cap with the most
    expected tokens per µs (ties to the larger), caps below MIN_CAP excluded; a capped round picks among the
    buckets up to its cap at its cost."""
    buckets = default_buckets(32)  # 1 .. 32; caps 8, 16, 32
    flat_t = (10.0,) * 6
    live = torch.ones(1, dtype=torch.int32)
    sure = torch.zeros(1, 33)  # every path certain: E(b) = 1 + b
    for head, want in (((50.0,) * 6, 5),  # caps cost the same: the full tree
                       ((50.0,) * 4 + (60.0, 500.0), 4),  # building 32 costs 440 µs more than 16: cap 16
                       ((5.0,) * 3 + (20.0, 400.0, 500.0), 3)):  # 9 tokens / 30 µs beats 17 / 410: cap 8
        ch = BucketChoice(buckets, "cpu")
        ch.set_curve(CostCurve(buckets, flat_t, head[-1], "caps", head))
        assert ch.caps == (3, 4, 5) and int(ch.hint) == 5
        ch.select(sure, live)  # a full round
        assert int(ch.hint) == want and int(ch.pick) == 5, (head, int(ch.hint))
        snap = ch.snapshot()
        ch.select(sure, torch.zeros(1, dtype=torch.int32))  # a frozen round scores nothing
        assert torch.equal(ch.value, snap[2])
    ch.select(sure, live, cap=3)  # capped at bucket 8: the pick is at most 8
    assert int(ch.pick) == 3 and ch.hot.tolist() == [False, False, False, True, False, False]
    ch.set_curve(CostCurve(buckets, flat_t, 50.0, "another"))  # a new curve: the caps' scores start over
    assert ch.value.abs().sum() == 0 and int(ch.hint) == 5


def test_curve_head_us(tmp_path):
    curve = CostCurve((1, 4, 16), (1.0, 2.0, 4.0), 30.0, "x", (10.0, 20.0, 30.0))
    assert CostCurve.load(curve.save(tmp_path / "c")) == curve
    assert curve.head_at((1, 2, 16)) == [10.0, 40.0 / 3, 30.0] and curve.cost_at((1, 4)) == [21.0, 22.0]
    assert CURVE.head_at((1, 16)) == [60.0, 60.0]  # no head_us: C at every bucket
    for edit, message in ((dict(head_us=[1.0]), "key 'head_us' has 1 values for 3 buckets"),
                          (dict(head_us=[1.0, -1.0, 2.0]), "key 'head_us' must be finite and >= 0"),
                          (dict(head_us="x"), "key 'head_us' must be a list of numbers")):
        d = {**curve.to_dict(), **edit}
        with pytest.raises(CurveError, match=re.escape(message)):
            CostCurve.from_dict(d)


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from decoding import load_pair
    path = tiny.get("small")
    drafter_dir = tmp_path_factory.mktemp("budget-auto") / "drafter"
    make_tiny_drafter(path, drafter_dir)
    m = load_pair(path, drafter_dir)
    rng = random.Random(4)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(2)]
    from runtime.engine.engine import Engine
    ar = Engine.from_models(m.target, None, None, "none").generate_batch_ids(prompts, NEW)
    m.path, m.drafter_dir = path, drafter_dir
    return m, prompts, ar


@pytest.mark.parametrize("batch", [1, 2])
def test_auto_is_lossless_and_moves_between_buckets(pair, batch):
    from agreeing_drafter import AgreeingDrafter
    from runtime.engine.engine import Engine
    m, prompts, ar = pair
    d = AgreeingDrafter(m.target, miss_prob=0.3, seed=batch)
    eng = Engine.from_models(m.target, d, None, "ddtree", "auto:16", budget_curve=CURVE)
    out = eng.generate_batch_ids(prompts[:batch], NEW)
    st = eng.last_stats
    assert out == ar[:batch]
    assert st["budget"] == "auto:16" and st["budget_curve"] == "given" and st["budget_buckets"] == [1, 2, 4, 8, 16]
    assert len(st["budget_histogram"]) >= 2, st["budget_histogram"]  # the choice follows the drafter's confidence
    assert sum(st["budget_histogram"].values()) == st["decode_rounds"]


def test_auto_caps_the_tree_it_builds_and_stays_lossless(pair):
    """A curve where building 16 nodes costs far more than 8: most rounds build the tree at 8 (the full tree
    every EXPLORE-th round), AR's tokens; without head_us every round builds the full tree."""
    from agreeing_drafter import AgreeingDrafter
    from runtime.decode.budget import EXPLORE
    from runtime.engine.engine import Engine
    m, prompts, ar = pair
    dear = CostCurve((1, 2, 4, 8, 16), (10.0,) * 5, 400.0, "dear full tree", (20.0,) * 4 + (400.0,))
    for curve, capped in ((dear, True), (CURVE, False)):
        d = AgreeingDrafter(m.target, miss_prob=0.3, seed=5)
        eng = Engine.from_models(m.target, d, None, "ddtree", "auto:16", budget_curve=curve)
        out = eng.generate_batch_ids(prompts, NEW)
        st = eng.last_stats
        assert out == ar, curve.source
        rounds = st["decode_rounds"]
        if capped:
            assert st["budget_caps"] == {8: rounds - (rounds + EXPLORE - 1) // EXPLORE,
                                         16: (rounds + EXPLORE - 1) // EXPLORE}, st["budget_caps"]
            assert max(b for b, k in st["budget_histogram"].items()) <= 16
        else:
            assert st["budget_caps"] == {16: rounds}


def test_auto_measures_its_curve_once_and_stores_it(pair, tmp_path):
    from runtime.engine.engine import Engine
    m, prompts, ar = pair
    runs = []
    for _ in range(2):  # a fresh engine (fresh sessions) each time: the second finds the stored curve
        eng = Engine.from_models(m.target, m.drafter, None, "ddtree", "auto:4", autotune_dir=tmp_path)
        out = eng.generate_batch_ids(prompts[:1], 6)
        runs.append(eng.last_stats["budget_curve"])
        assert out == [ar[0][:6]]
    files = list(tmp_path.glob("*/curve.json"))
    assert [f.parent.name for f in files] == ["cpu-float64-eager-b1-B4"]
    assert runs == [f"measured, stored: {files[0]}", f"stored: {files[0]}"]
    curve = CostCurve.load(files[0])
    assert curve.buckets == (1, 2, 4) and curve.fixed_us > 0 and "eager rounds" in curve.source


def test_a_stored_curve_without_head_us_is_measured_again(pair, tmp_path):
    """A curve stored before heads per cap existed would never cap the tree: a session with caps measures anew."""
    from runtime.engine.engine import Engine
    m, prompts, ar = pair
    old = CostCurve((1, 2, 4, 8, 16), (1.0,) * 5, 10.0, "stored before caps")
    path = old.save(tmp_path / "cpu-float64-eager-b1-B16")
    eng = Engine.from_models(m.target, m.drafter, None, "ddtree", "auto:16", autotune_dir=tmp_path)
    assert list(eng.generate_ids(prompts[0], 4)) == ar[0][:4]
    assert eng.last_stats["budget_curve"] == f"measured, stored: {path}"
    assert len(CostCurve.load(path).head_us) == 5


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("verify_us"), "key 'verify_us' is missing"),
    (lambda d: d.update(buckets=[1, 4, 2]), "key 'buckets' must be strictly increasing"),
    (lambda d: d.update(buckets=[0, 1, 2]), "key 'buckets' must be strictly increasing integers >= 1"),
    (lambda d: d.update(buckets=[1.5, 2, 4]), "key 'buckets' must be a list of integers"),
    (lambda d: d.update(verify_us=[1.0, 2.0]), "key 'verify_us' has 2 values for 3 buckets"),
    (lambda d: d.update(verify_us=[1.0, float("nan"), 3.0]), "key 'verify_us' must be finite and >= 0"),
    (lambda d: d.update(verify_us=[1, "2", 3]), "key 'verify_us' must be a list of numbers"),
    (lambda d: d.update(fixed_us=-1), "key 'fixed_us' must be finite and >= 0"),
    (lambda d: d.update(fixed_us=None), "key 'fixed_us' must be a number"),
])
def test_curve_json_errors_name_the_file_and_key(tmp_path, edit, message):
    d = {"buckets": [1, 2, 4], "verify_us": [1.0, 2.0, 3.0], "fixed_us": 5.0}
    edit(d)
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CurveError) as exc:
        CostCurve.load(path)
    assert str(exc.value).startswith(f"{path}: {message}") and "\n" not in str(exc.value)


def test_curve_files_and_ranges(tmp_path):
    for text, message in (("{", "unreadable cost curve (JSONDecodeError"), ("[1, 2]", "must be a JSON object")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(CurveError, match=rf"^{re.escape(str(tmp_path / 'bad.json'))}: {re.escape(message)}"):
            CostCurve.load(tmp_path / "bad.json")
    with pytest.raises(CurveError, match="no such cost curve file"):
        CostCurve.load(tmp_path / "missing.json")
    path = CURVE.save(tmp_path / "x")
    assert CostCurve.load(path) == CURVE
    assert CURVE.cost_at((1, 3, 16)) == [70.0, 74.0, 100.0]  # 3: halfway between 2 and 4
    with pytest.raises(CurveError, match=r"cost curve \(hand-made\): covers budgets 1..16, the session needs 32"):
        BucketChoice(default_buckets(32), "cpu").set_curve(CURVE)


def test_budget_flags():
    assert parse_budget(16) == (16, False) and parse_budget("auto") == (256, True)
    assert parse_budget("auto:64") == (64, True) and parse_budget("8") == (8, False)
    assert SpecConfig.of("ddtree", "auto:8").budget_label == "auto:8"
    for bad, message in (("auto:", "budget must be an integer, auto or auto:N"), ("x", "budget must be an integer"),
                         ("auto:0", "budget must be >= 1")):
        with pytest.raises(InvalidParam, match=message):
            SpecConfig.of("ddtree", bad)
    with pytest.raises(InvalidParam, match="budget auto applies to spec ddtree, not chain"):
        SpecConfig.of("chain", "auto")
    with pytest.raises(InvalidParam, match="a cost curve applies to budget auto only"):
        SpecConfig.of("ddtree", 16, CURVE)


def test_default_budget_is_auto_on_cuda_and_fixed_on_cpu(pair):
    """No budget asked for: auto where a measured curve means something (CUDA), a fixed 16 on the CPU."""
    from runtime.engine.engine import Engine
    assert default_budget("cuda") == "auto" and default_budget("cuda:1") == "auto" and default_budget("cpu") == 16
    m, _, _ = pair
    eng = Engine.from_models(m.target, m.drafter, None, "ddtree")
    assert eng.spec_config.budget == 16 and not eng.spec_config.auto


def test_serve_budget_flag_fails_before_loading(tmp_path):
    """`kdtree serve --budget` takes B, auto or auto:B_MAX (the server's default for requests; the API's budget
    field takes the same, tests/test_serve.py); a bad one is one error line, before anything loads."""
    from typer.testing import CliRunner

    from runtime.cli import app
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--budget", "auto:x"])
    assert r.exit_code != 0 and "budget must be an integer, auto or auto:N, got 'auto:x'" in r.output, r.output




def test_kdtree_run_budget_auto(pair, tmp_path):
    """`kdtree run --budget auto:4`: AR's tokens, the curve measured on first use and stored in the artifact
    (found by the next session: test_auto_measures_its_curve_once_and_stores_it), --budget-curve FILE used
    as given; bad flags are one error line each, before anything loads."""
    from typer.testing import CliRunner

    from runtime.cli import app
    from runtime.engine.engine import Engine
    m, prompts, _ = pair
    ar = list(Engine.from_models(m.target, None, None, "none").generate_ids(prompts[0], 4))
    base = ["run", m.path, "--prompt-ids", ",".join(map(str, prompts[0])), "--max-new-tokens", "4", "--json",
            "--dtype", "float64", "--drafter", str(m.drafter_dir)]
    curve_file = tmp_path / "curve.json"
    curve_file.write_text(json.dumps(CURVE.to_dict()))
    notes = []
    for extra in ([], ["--budget-curve", str(curve_file)]):
        r = CliRunner().invoke(app, base + ["--budget", "auto:4", *extra])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["token_ids"] == ar and out["stats"]["budget"] == "auto:4"
        notes.append(out["stats"]["budget_curve"])
    stored = Path(notes[0].removeprefix("measured, stored: "))
    assert stored.parent.parent.name == "autotune" and stored.is_file() and notes[1] == "given", notes
    curve_file.write_text(json.dumps({"buckets": [1, 2], "verify_us": [1, 2]}))
    for args, needle in [(["--budget", "autox"], "--budget must be an integer, auto or auto:N, got 'autox'"),
                         (["--budget", "auto", "--budget-curve", str(curve_file)],
                          f"{curve_file}: key 'fixed_us' is missing"),
                         (["--budget", "8", "--budget-curve", str(tmp_path / "none.json")],
                          "no such cost curve file")]:
        r = CliRunner().invoke(app, base + args)
        assert r.exit_code == 1 and needle in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
