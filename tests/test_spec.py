"""Speculative decoding on the reference path: DDTree and chain are lossless against plain AR."""

from __future__ import annotations

import random

import pytest
import torch

from agreeing_drafter import AgreeingDrafter
from build_pipeline.tiny_drafter import make_tiny_drafter
from decoding import decode, load_pair
from plugins.common.bitmask import causal_mask
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.decode.prefill import commit_chain, prefill
from runtime.decode.session import DecodeSession
from runtime.decode.stats import DecodeStats

NEW_TOKENS = 128
BUDGETS = [1, 4, 16, 64, 256]


def _prompts(n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(n)]


class Setup:
    """A target (bf16 or INT4 experts), its DFlash drafter, and AR references with a stop token.

    Computed in float64: the check is that speculation is lossless, and in fp32 the batch shape
    alone (20 requests at once vs one) can flip a near-tied argmax in 20 x 128 tokens."""

    def __init__(self, tiny, int4: bool, tmp):
        path = tiny.get("small", int4=int4)
        drafter_dir = tmp / f"drafter-{int4}"
        make_tiny_drafter(path, drafter_dir)
        m = load_pair(path, drafter_dir)
        self.target, self.dflash = m.target, m.drafter
        self.prompts = _prompts()
        free, _ = decode(self.target, None, self.prompts, SamplingParams(NEW_TOKENS))
        self.stop = free[0][NEW_TOKENS // 2]  # appears mid-way in prompt 0's output, so some requests stop early
        self.params = SamplingParams(NEW_TOKENS, stop_ids=(self.stop,))
        self.ar, _ = decode(self.target, None, self.prompts, self.params)
        assert self.ar[5] == decode(self.target, None, [self.prompts[5]], self.params)[0][0]  # batch == single
        assert any(len(o) < NEW_TOKENS for o in self.ar) and any(len(o) == NEW_TOKENS for o in self.ar)


@pytest.fixture(scope="module")
def setups(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafters")
    return {int4: Setup(tiny, int4, tmp) for int4 in (False, True)}


# every (mode, budget) x drafter with INT4 experts (the format with more code), bf16 experts at the chain and budget
# 16 (the expert format does not reach the speculative code: the rest of its matrix took ~70 s of CI); the random
# DFlash drafter stops at budget 64 (at 256 every round verifies 257 tokens, as it rarely agrees: ~75 s a case on two
# CPU cores), the agreeing one takes budget 256's trees
CASES = [(int4, drafter, mode, budget) for mode, budget in [("chain", 0)] + [("ddtree", b) for b in BUDGETS]
         for drafter in ("dflash", "agreeing") for int4 in (False, True)
         if (int4 or budget in (0, 16)) and not (drafter == "dflash" and budget == 256)]


@pytest.mark.parametrize("int4,drafter,mode,budget", CASES,
                         ids=[f"{m}-{b}-{d}-{'int4' if i else 'bf16'}" for i, d, m, b in CASES])
def test_speculative_greedy_equals_ar(setups, int4, drafter, mode, budget):
    s = setups[int4]
    d = s.dflash if drafter == "dflash" else AgreeingDrafter(s.target, miss_prob=0.3, seed=budget)
    out, stats = decode(s.target, d, s.prompts, s.params, mode, max(budget, 1))
    assert out == s.ar
    if drafter == "agreeing" and budget >= 16:
        assert stats["tau"] > 3.0  # the tree recovers the planted misses


def test_tau_reaches_block_size_with_a_perfect_drafter(setups):
    s = setups[False]
    params = SamplingParams(NEW_TOKENS)
    out, stats = decode(s.target, AgreeingDrafter(s.target, miss_prob=0.0), s.prompts[:4], params, "chain")
    assert out == [decode(s.target, None, [p], params)[0][0] for p in s.prompts[:4]]
    hist = stats["accept_len_histogram"]
    assert max(hist) == 8 and hist[8] >= 0.9 * sum(hist.values())  # all full blocks but the tails


def test_accept_lengths_cover_1_to_block_size(setups):
    s = setups[False]
    _, stats = decode(s.target, AgreeingDrafter(s.target, miss_prob=0.25, seed=3), s.prompts, s.params, "chain")
    assert set(stats["accept_len_histogram"]) == set(range(1, 9))


def test_committed_cache_after_one_round_equals_ar_cache(setups):
    s = setups[False]
    prompt = s.prompts[3]
    d = AgreeingDrafter(s.target, miss_prob=0.3, seed=1)
    session = DecodeSession(s.target, d, SpecConfig("ddtree", 16), 1, len(prompt) + NEW_TOKENS)
    rounds = session.rounds([prompt], SamplingParams(NEW_TOKENS), False, DecodeStats())
    first = next(rounds)[0]
    second = next(rounds)[0]
    cache = session.cache
    committed = prompt + first + second[:-1]  # the last emitted token (the bonus) is not yet in the cache
    assert int(cache.lens[0]) == len(committed)
    ref = s.target.new_cache(1, len(committed) + 1, 1)
    prefill(s.target, ref, torch.tensor(prompt[:1]))
    for t in committed[1:]:  # AR, one token at a time
        s.target.forward(torch.tensor([[t]]), ref.lens[:, None].long(), ref, causal_mask(1, 1))
        commit_chain(ref, 1)
    n = len(committed)
    torch.testing.assert_close(cache.kv[:, 0, :n], ref.kv[:, 0, :n], rtol=1e-5, atol=1e-5)


def test_sampling_at_temperature_1_matches_the_target_distribution(setups):
    """Many seeded runs of 2 tokens: the 2nd token (emitted through the tree walk) must follow the
    target's softmax given the 1st.  Chi-square over the likely tokens plus one 'rest' bin;
    threshold: p > 1e-3 (the test is deterministic: fixed seeds)."""
    from scipy.stats import chisquare

    s = setups[False]
    prompt = s.prompts[0]
    runs = 1500
    params = SamplingParams(2, temperature=1.0, seed=11)
    d = AgreeingDrafter(s.target, miss_prob=0.3, seed=5)
    out, _ = decode(s.target, d, [prompt] * runs, params, "ddtree", 16)
    firsts = [o[0] for o in out]
    t1 = max(set(firsts), key=firsts.count)
    seconds = [o[1] for o in out if o[0] == t1]
    cache = s.target.new_cache(1, len(prompt) + 2, len(prompt) + 1)
    h, _ = prefill(s.target, cache, torch.tensor(prompt + [t1]))
    probs = torch.softmax(s.target.logits(h), -1).double()
    likely = [int(i) for i in torch.nonzero(probs * len(seconds) >= 5).flatten()]
    observed = [seconds.count(t) for t in likely] + [sum(1 for t in seconds if t not in likely)]
    expected = [float(probs[t]) * len(seconds) for t in likely]
    expected.append(len(seconds) - sum(expected))
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert len(seconds) > 200 and len(likely) >= 2
    assert chisquare(observed, expected).pvalue > 1e-3
