"""GPU: `--budget auto` with CUDA graphs: one composed round, a SWITCH node over the buckets (or one IF node per
bucket), the bucket chosen on the device.

On the tiny Kimi model in fp32 with its tiny DFlash drafter (as tests/test_graphs_gpu.py, whose CPU
reference and near-tie rule this reuses):
- tree_build's Triton kernels are prefix-closed at the Kimi vocabulary (B 256 -> every bucket);
- every bucket's body is right (SWITCH node, and the IF-node form): with the choice forced to one bucket
  (BucketChoice.force, read by the graph on each replay), graph rounds give the AR tokens, batch 3;
- the choice itself: under a cost curve balanced on the drafter's own expected-token estimates (taken
  from an eager run), the captured graph verifies different buckets on different rounds, with the AR
  tokens; a capture cannot hold a host read, so the graph chose them itself;
- with no curve the session measures one by replaying its graph (and stores it under autotune/);
- the fallback without conditional nodes (HostChoiceRound: the host reads the bucket) gives the same tokens and
  buckets;
- under a curve where the full tree is dear, most rounds replay the graph of the tree capped at 8 nodes
  (the full tree every EXPLORE-th round), with the AR tokens.

Writes $KDTREE_RESULTS_DIR/budget-auto-device-test.json (histograms, curves, mismatches).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from plugins.budget_choice import expected_tokens
from runtime.decode.budget import CostCurve

pytestmark = pytest.mark.gpu

AUTO = "auto:16"
REPORT: dict = {}


@pytest.fixture(scope="module")
def ref(tiny, tmp_path_factory):
    from test_graphs_gpu import Reference
    r = Reference(tiny, tmp_path_factory.mktemp("budget-auto-gpu"))
    yield r
    out = os.environ.get("KDTREE_RESULTS_DIR")
    if out:
        doc = {"test": "budget-auto-graphs", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "safe_prefix": r.safe, **REPORT}
        Path(out, "budget-auto-device-test.json").write_text(json.dumps(doc, indent=1) + "\n")


def _session(eng, batch: int = 3):
    """The engine's decode session of `batch` requests (its runner keeps them per spec and batch)."""
    return eng.runner._sessions[(*eng.spec_config.key, batch)]


def test_tree_build_kernel_is_prefix_closed_on_gpu():
    from test_tree_build_kernel import check_prefix_closed
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab, big in ((163840, 256), (4099, 64)):
        logits = torch.randn(2, 7, vocab, device="cuda", generator=gen) * 3
        assert not check_prefix_closed(logits, big, (1, 2, 4, 8, 16, 32, 64, 128)[:big.bit_length() - 1],
                                       kernel=True)


def test_each_bucket_body_gives_the_ar_tokens(ref):
    from test_graphs_gpu import NEW, _diff
    curve = CostCurve((1, 16), (1.0, 1.0), 1.0, "flat")
    eng = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=True, budget_curve=curve)
    eng.generate_batch_ids(ref.prompts, 4)  # capture
    s = _session(eng)
    errs, used = {}, {}
    for i, b in enumerate(s.choice.buckets):
        s.choice.force.fill_(i)  # every replay of the captured round verifies bucket i
        try:
            out = eng.generate_batch_ids(ref.prompts, NEW)
        finally:
            s.choice.force.fill_(-1)
        st = eng.last_stats
        errs[b], used[b] = _diff(ref, out), (st["graphs"], st["budget_histogram"], st.get("graph_note"))
    REPORT["forced"] = {"errors": errs, "graphs_and_histogram": used}
    assert all(g and list(h) == [b] for b, (g, h, _) in used.items()), used
    assert not any(errs.values()), errs


def test_if_node_form_gives_the_same_rounds(ref, monkeypatch):
    """The composition with one IF node per bucket (where a driver refuses SWITCH nodes): every bucket forced
    through it gives the AR tokens, as through the SWITCH node."""
    import functools

    from test_graphs_gpu import NEW, _diff

    import runtime.decode.session as session_mod
    from runtime.decode.conditional import ConditionalRound
    monkeypatch.setattr(session_mod, "ConditionalRound", functools.partial(ConditionalRound, form="if"))
    curve = CostCurve((1, 16), (1.0, 1.0), 1.0, "flat")
    eng = ref.gpu.configure(spec="ddtree", budget="auto:8", graphs=True, budget_curve=curve)
    eng.generate_batch_ids(ref.prompts, 4)  # capture
    s = _session(eng)
    errs = {}
    for i, b in enumerate(s.choice.buckets):
        s.choice.force.fill_(i)
        try:
            errs[b] = _diff(ref, eng.generate_batch_ids(ref.prompts, NEW))
        finally:
            s.choice.force.fill_(-1)
        st = eng.last_stats
        assert st["graph_via"] == "cuda-python (IF nodes)" and list(st["budget_histogram"]) == [b], st
    REPORT["if_form"] = {"errors": errs}
    assert not any(errs.values()), errs


def test_capped_tree_graphs_give_the_ar_tokens(ref):
    from test_graphs_gpu import NEW, _diff

    from runtime.decode.budget import EXPLORE
    dear = CostCurve((1, 8, 16), (1.0, 1.0, 1.0), 400.0, "dear full tree", (1.0, 1.0, 400.0))
    eng = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=True, budget_curve=dear)
    out = eng.generate_batch_ids(ref.prompts, NEW)
    st = eng.last_stats
    # every EXPLORE-th round is full, and so are the rounds launched before the first full round's hint is
    # read back: on CUDA the next round is launched while one is in flight (len(pinned) slots)
    rounds, ahead = st["decode_rounds"], len(_session(eng).pinned) - 1
    full = (rounds + EXPLORE - 1) // EXPLORE + min(ahead, rounds - 1)
    REPORT["capped"] = {"caps": st["budget_caps"], "histogram": st["budget_histogram"], "errors": _diff(ref, out)}
    assert st["graphs"] and st["budget_caps"] == {8: rounds - full, 16: full}, st["budget_caps"]
    assert not _diff(ref, out)


def test_graph_chooses_different_buckets_per_round(ref):
    from test_graphs_gpu import NEW, _diff
    flat = CostCurve((1, 16), (1.0, 1.0), 1.0, "flat")
    eager = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=False, budget_curve=flat)
    eager.generate_batch_ids(ref.prompts, 2)  # make the session
    s = _session(eager)
    seen: list[list[float]] = []
    select = s.choice.select

    def record(scores, live, cap=None):  # eager rounds only: the host may read the device here
        if cap is None or cap == len(s.choice.buckets) - 1:  # full rounds: every bucket's estimate is current
            e = expected_tokens(scores, live, s.choice.sizes, s.choice.scale())
            seen.append((e / live.sum().clamp(min=1)).tolist())
        select(scores, live, cap)

    s.choice.select = record
    try:
        eager.generate_batch_ids(ref.prompts, NEW)
    finally:
        del s.choice.select
    per_bucket = [statistics.median(e[i] for e in seen) for i in range(len(s.choice.buckets))]
    # cost proportional to the median estimate: every bucket is as good at the median, each round's own
    # estimates decide
    balanced = CostCurve(s.choice.buckets, tuple(100.0 * e for e in per_bucket), 0.0, "balanced on the drafter")
    eng = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=True, budget_curve=balanced)
    out = eng.generate_batch_ids(ref.prompts, NEW)
    st = eng.last_stats
    eager_b = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=False, budget_curve=balanced)
    out_eager = eager_b.generate_batch_ids(ref.prompts, NEW)
    REPORT["chosen"] = {"median_expected_tokens": per_bucket, "graphs": st["graphs"],
                        "graph_histogram": st["budget_histogram"],
                        "eager_histogram": eager_b.last_stats["budget_histogram"],
                        "errors": _diff(ref, out), "eager_errors": _diff(ref, out_eager)}
    print(f"\nbudget auto: graph rounds per bucket {st['budget_histogram']}, eager "
          f"{eager_b.last_stats['budget_histogram']}")
    assert st["graphs"] and st["graph_via"] == "cuda-python (SWITCH node)", st.get("graph_note")
    assert len(st["budget_histogram"]) >= 2, st["budget_histogram"]
    assert not _diff(ref, out) and not _diff(ref, out_eager)


def test_session_measures_its_curve_by_replaying_the_graph(ref, tmp_path):
    from runtime.engine.engine import Engine
    gpu = ref.gpu.runner
    eng = Engine.from_models(gpu.target, gpu.drafter, None, "ddtree", AUTO, graphs=True, autotune_dir=tmp_path)
    list(eng.generate_ids(ref.prompts[0], 8))
    st = eng.last_stats
    files = list(tmp_path.glob("*/curve.json"))
    curve = CostCurve.load(files[0]) if files else None
    REPORT["measured"] = {"note": st["budget_curve"], "curve": curve.to_dict() if curve else None,
                          "histogram": st["budget_histogram"]}
    assert st["graphs"], st.get("graph_note")
    assert len(files) == 1 and files[0].parent.name.endswith("-float32-graphs-b1-B16"), files
    assert "graph replays" in curve.source and curve.fixed_us > 0
    assert st["budget_curve"] == f"measured, stored: {files[0]}"


def test_host_choice_fallback_gives_the_same_rounds(ref, monkeypatch):
    from test_graphs_gpu import NEW, _diff

    import runtime.decode.session as session_mod
    from plugins.common.cubin import CubinUnavailable

    def unavailable(*args, **kwargs):
        raise CubinUnavailable("disabled by the test")

    flat = CostCurve((1, 16), (1.0, 2.0), 1.0, "flat")
    eng = ref.gpu.configure(spec="ddtree", budget=AUTO, graphs=True, budget_curve=flat)
    out_if = eng.generate_batch_ids(ref.prompts, NEW)
    hist_if = eng.last_stats["budget_histogram"]
    monkeypatch.setattr(session_mod, "setter_cubin", unavailable)
    host = ref.gpu.configure(spec="ddtree", budget="auto:8", graphs=True, budget_curve=flat)
    out_host = host.generate_batch_ids(ref.prompts, NEW)
    st = host.last_stats
    REPORT["host_choice"] = {"via": st["graph_via"], "note": st.get("graph_note"), "histogram": st["budget_histogram"],
                             "errors": _diff(ref, out_host), "if_histogram": hist_if}
    assert st["graphs"] and st["graph_via"] == "torch (host reads the bucket)", st.get("graph_note")
    assert "disabled by the test" in st["graph_note"]
    assert not _diff(ref, out_host) and not _diff(ref, out_if)
