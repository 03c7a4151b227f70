"""The reference model against transformers' DeepseekV3ForCausalLM: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch

from runtime.generate import SamplingParams, generate_ar, prefill
from runtime.model import load_target

PRESETS = ["kimi", "grouped", "no-q-lora", "dense2"]
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3, 250]


@pytest.fixture(scope="module")
def hf_cls():
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3ForCausalLM


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_and_logits_match_transformers(tiny, hf_cls, preset):
    path = tiny.get(preset)
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, progress=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    got = list(generate_ar(ours, PROMPT, SamplingParams(max_new_tokens=64)))
    assert got == ref

    seq = torch.tensor(PROMPT + ref[:40])
    with torch.no_grad():
        ref_logits = hf(seq[None]).logits[0, -1].float()
    cache = ours.new_cache(1, 128, 16)  # prefill in chunks of 16: the chunked path is exercised too
    hidden, _ = prefill(ours, cache, seq)
    rel = (ours.logits(hidden) - ref_logits).norm() / ref_logits.norm()
    assert rel < 1e-4, f"last-token logits rel err {rel:.2e}"


def test_moonshot_kimi_k2_dialect_loads_the_same_model(tiny):
    base = list(generate_ar(load_target(tiny.get("kimi"), progress=False), PROMPT, SamplingParams(24)))
    k2 = list(generate_ar(load_target(tiny.get("kimi", dialect="kimi_k2"), progress=False), PROMPT, SamplingParams(24)))
    assert k2 == base


def test_int4_model_matches_its_dequantised_bf16_twin(tiny):
    int4 = load_target(tiny.get("kimi", int4=True), progress=False)
    twin = load_target(tiny.get("kimi", int4=True, twin=True), progress=False)
    for a, b in zip(int4.w.layers[1].mlp.w13, twin.w.layers[1].mlp.w13):
        assert torch.equal(a, b)
    got = list(generate_ar(int4, PROMPT, SamplingParams(64)))
    assert got == list(generate_ar(twin, PROMPT, SamplingParams(64)))


def test_kimi25_int4_layout_matches_plain_int4(tiny, hf_cls):
    k25 = load_target(tiny.get("kimi", int4=True, kimi25=True), progress=False)
    plain = load_target(tiny.get("kimi", int4=True), progress=False)
    assert list(generate_ar(k25, PROMPT, SamplingParams(32))) == list(generate_ar(plain, PROMPT, SamplingParams(32)))
    # and the twin (plain bf16, loadable by transformers) agrees with transformers
    twin_path = tiny.get("kimi", int4=True, twin=True)
    hf = hf_cls.from_pretrained(twin_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert list(generate_ar(k25, PROMPT, SamplingParams(32))) == ref


def test_sampling_is_seeded_and_stops_on_stop_token(tiny):
    model = load_target(tiny.get("kimi"), progress=False)
    a = list(generate_ar(model, PROMPT, SamplingParams(20, temperature=1.0, seed=7)))
    b = list(generate_ar(model, PROMPT, SamplingParams(20, temperature=1.0, seed=7)))
    assert a == b
    greedy = list(generate_ar(model, PROMPT, SamplingParams(20)))
    stop = greedy[5]
    first = greedy.index(stop)
    cut = list(generate_ar(model, PROMPT, SamplingParams(20, stop_ids=(stop,))))
    assert cut == greedy[: first + 1]
