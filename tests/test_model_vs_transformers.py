"""The reference model against transformers' DeepseekV3ForCausalLM: greedy tokens and logits.

Our side is loaded the one way the runtime loads (checkpoint -> build cache -> artifact, fp32 on the
CPU) and decoded through the Engine (tests/decoding.py), which always adds the config's eos ids to
the stops: a tiny model's greedy output that hit one would end early and fail the identity checks."""

from __future__ import annotations

import pytest
import torch
from decoding import decode, load_pair

from plugins.moe_w4a16 import dequantize_experts
from runtime.decode.params import SamplingParams
from runtime.decode.prefill import prefill

PRESETS = ["kimi", "grouped", "no-q-lora", "dense2"]
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3, 250]


def _load(path):
    return load_pair(path, dtype=torch.float32).target


def _tokens(model, n: int, **params) -> list[int]:
    """The new tokens of PROMPT (greedy unless params say otherwise), through the Engine."""
    outs, _ = decode(model, None, [PROMPT], SamplingParams(n, **params))
    return outs[0]


@pytest.fixture(scope="module")
def hf_cls():
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3ForCausalLM


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_and_logits_match_transformers(tiny, hf_cls, preset):
    path = tiny.get(preset)
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = _load(path)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    got = _tokens(ours, 64)
    assert got == ref

    seq = torch.tensor(PROMPT + ref[:40])
    with torch.no_grad():
        ref_logits = hf(seq[None]).logits[0, -1].float()
    cache = ours.new_cache(1, 128, 16)  # prefill in chunks of 16: the chunked path is exercised too
    hidden, _ = prefill(ours, cache, seq)
    rel = (ours.logits(hidden) - ref_logits).norm() / ref_logits.norm()
    assert rel < 1e-4, f"last-token logits rel err {rel:.2e}"


def test_moonshot_kimi_k2_dialect_loads_the_same_model(tiny):
    base = _tokens(_load(tiny.get("kimi")), 24)
    k2 = _tokens(_load(tiny.get("kimi", dialect="kimi_k2")), 24)
    assert k2 == base and len(base) == 24


def test_int4_model_matches_its_dequantised_bf16_twin(tiny):
    int4 = _load(tiny.get("kimi", int4=True))
    twin = _load(tiny.get("kimi", int4=True, twin=True))
    packed, dense = int4.w.layers[1].mlp.experts, twin.w.layers[1].mlp.experts
    assert packed.w13.dtype == torch.int32 and packed.w13_scale is not None  # held packed only
    assert dense.w13.dtype == torch.float32 and dense.w13_scale is None
    d, i = int4.cfg.hidden_size, int4.cfg.moe_intermediate_size
    got13, got2 = dequantize_experts(packed.w13, packed.w13_scale, packed.w2, packed.w2_scale, d)
    assert torch.equal(got13, dense.w13) and torch.equal(got2, dense.w2) and got2.shape[-1] == i
    got = _tokens(int4, 64)
    assert got == _tokens(twin, 64) and len(got) == 64


def test_kimi25_int4_layout_matches_plain_int4(tiny, hf_cls):
    k25 = _load(tiny.get("kimi", int4=True, kimi25=True))
    plain = _load(tiny.get("kimi", int4=True))
    assert _tokens(k25, 32) == _tokens(plain, 32)
    # and the twin (plain bf16, loadable by transformers) agrees with transformers
    twin_path = tiny.get("kimi", int4=True, twin=True)
    hf = hf_cls.from_pretrained(twin_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert _tokens(k25, 32) == ref


def test_sampling_is_seeded_and_stops_on_stop_token(tiny):
    model = _load(tiny.get("kimi"))
    a = _tokens(model, 20, temperature=1.0, seed=7)
    b = _tokens(model, 20, temperature=1.0, seed=7)
    assert a == b
    greedy = _tokens(model, 20)
    stop = greedy[5]
    first = greedy.index(stop)
    cut = _tokens(model, 20, stop_ids=(stop,))
    assert cut == greedy[: first + 1]
