"""`kdtree serve` on loopback (CPU, tiny model), driven by the official `openai` client.

KDTREE_TEST_DEVICE=cuda runs the same tests with the servers, `kdtree run` and the in-process engine
on the GPU (benchmarks/serve_device.sh), all in fp32 there as on the CPU: bf16 rounding alone changes
greedy tokens between a batch of 4 rows and a batch of 1; the `--tp 2` test needs two GPUs there.

Three real servers (subprocesses started through the CLI, on free ports): a DDTree one with an API
key and a batch of 4, over a copy of the tiny checkpoint that ships a Jinja chat template; an AR one
with one slot and a queue of one (429, disconnect; no chat template: Kimi's markers); a `--tp 2` one
whose rank 1 is made to crash after a few requests (503, exit 1, one error line).  The reference is
`kdtree run` itself for one request and the in-process Engine (what `kdtree run` calls) for the rest;
transformers' renderer for chat templates; the scheduler in process for a long prompt's chunked join.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

# the client's package is in the CPU suite's install (.ci/run); the GPU machine may lack it, and `pytest -m gpu`
# still imports every module
openai = pytest.importorskip("openai")

from benchmarks.serve_join import SHORT, join_stall, read_events
from benchmarks.serve_load import ROOT, ServerProcess, drive
from build_pipeline.tiny_drafter import make_tiny_drafter
from runtime.decode.params import SamplingParams, SpecConfig
from runtime.decode.session import PREFILL_CHUNK
from runtime.engine.engine import Engine
from runtime.serve.lanes import LocalLanes
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import Generation
from runtime.serve.scheduler import Job, Scheduler
from runtime.serve.template import ChatTemplate, TemplateFailed

KEY = "sk-test-key"
DEVICE = os.environ.get("KDTREE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"KDTREE_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("KDTREE_TEST_DEVICE=cuda: no CUDA device is available")
ON_DEVICE = ("--device", DEVICE, "--dtype", "float32")  # the servers' and `kdtree run`'s arguments
PROMPT = "The quick brown fox"
# one torch thread per process: the servers and this process share the CI's 2 cores, and idle OpenMP
# threads spinning beside another busy process slow tiny matmuls by orders of magnitude
ONE_THREAD = {"OMP_NUM_THREADS": "1", "KDTREE_RANK_THREADS": "1"}
# Kimi's layout as a Jinja template (what tokenizer_config.json's chat_template renders for these roles),
# refusing other roles through raise_exception
KIMI_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{%- endif -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for p in m['content'] -%}{{ p['text'] }}{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def paths(tiny, tmp_path_factory):
    path = tiny.get("kimi")
    dr = tmp_path_factory.mktemp("serve") / "dr"
    make_tiny_drafter(path, dr)
    return path, str(dr)


@pytest.fixture(scope="module")
def templated(paths, tmp_path_factory) -> str:
    """The tiny checkpoint (same weights, same name) with KIMI_TEMPLATE in its tokenizer_config.json."""
    src = Path(paths[0])
    out = tmp_path_factory.mktemp("templated") / src.name
    shutil.copytree(src, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=KIMI_TEMPLATE)))
    return str(out)


@pytest.fixture(scope="module")
def servers(paths, templated):
    path, dr = paths
    main = ServerProcess(templated, "--drafter", dr, "--budget", "8", "--max-batch", "4", "--max-model-len", "160",
                         "--api-key", KEY, *ON_DEVICE, env=ONE_THREAD)
    small = ServerProcess(path, "--max-batch", "1", "--max-queue", "1", "--max-model-len", "1024", *ON_DEVICE,
                          env=ONE_THREAD)
    try:
        yield main.wait(), small.wait()
    finally:
        main.stop()
        small.stop()


@pytest.fixture(scope="module")
def engine(paths):
    path, dr = paths
    return Engine.load(path, device=DEVICE, drafter=dr, spec="ddtree", budget=8, dtype=torch.float32)


def _client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=60)


def _stream_text(stream) -> tuple[str, list[int], str, dict | None]:
    """Concatenated text, token ids, finish reason and usage of a streamed answer."""
    text, ids, finish, usage = [], [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text.append(piece or "")
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    return "".join(text), ids, finish, usage


def test_completions_equal_kdtree_run(servers, paths):
    main, _ = servers
    path, dr = paths
    run = subprocess.run([sys.executable, "-m", "runtime.cli", "run", path, "--drafter", dr, "--spec", "ddtree",
                          "--budget", "8", "--prompt", PROMPT, "--max-new-tokens", "40", *ON_DEVICE, "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, **ONE_THREAD})
    assert run.returncode == 0, run.stderr
    ref = json.loads(run.stdout)
    client = _client(main)
    extra = {"return_token_ids": True}
    got = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    c = got.choices[0]
    assert c.model_extra["token_ids"] == ref["token_ids"] and c.text == ref["text"]
    assert got.usage.completion_tokens == len(ref["token_ids"]) and c.finish_reason in ("stop", "length")
    streamed = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)
    text, ids, finish, usage = _stream_text(streamed)
    assert (text, ids, finish) == (ref["text"], ref["token_ids"], c.finish_reason)
    assert usage["completion_tokens"] == len(ids) and usage["prompt_tokens"] == got.usage.prompt_tokens


def test_chat_equals_engine(servers, engine):
    """Through the checkpoint's chat template (main) and through Kimi's markers (small: no template),
    streamed and not: the tokens of `kdtree run --chat`'s prompt."""
    tok = engine.tokenizer
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    ref = list(engine.generate_ids(tok.chat("hello there", system="be brief"), 30))
    ref_text = tok.decode([t for t in ref if t not in engine.stop_ids()[0]])
    for server in servers:
        client = _client(server)
        got = client.chat.completions.create(model="kimi-hf", messages=msgs, max_tokens=30, temperature=0,
                                             extra_body={"return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == ref and got.choices[0].message.content == ref_text
        assert got.usage.prompt_tokens == len(tok.chat("hello there", system="be brief"))
        text, ids, _, _ = _stream_text(client.chat.completions.create(
            model="kimi-hf", messages=msgs, max_tokens=30, temperature=0, stream=True,
            extra_body={"return_token_ids": True}))
        assert (text, ids) == (ref_text, ref)


def test_chat_template_that_fails_is_a_400(servers):
    main, small = servers
    bad = [{"role": "tool", "content": "42", "tool_call_id": "t1"}]
    with pytest.raises(openai.BadRequestError, match="chat template failed on these messages: unsupported role "
                                                     "tool") as e:
        _client(main).chat.completions.create(model="kimi-hf", messages=bad, max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content: only text parts"):
        _client(main).chat.completions.create(model="kimi-hf", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    got = _client(small).chat.completions.create(model="kimi-hf", messages=bad, max_tokens=2)  # markers: tool is fine
    assert got.usage.completion_tokens >= 1


def test_chat_template_renders_as_transformers_does():
    """The sandboxed renderer against transformers' own (render_jinja_template) on a template using what
    transformers gives templates; what a template must not do fails, and a syntax error names the line."""
    from transformers.utils.chat_template_utils import render_jinja_template

    features = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
                "{% if loop.index > 3 %}{% break %}{% endif %}\n  {% set ns.n = ns.n + 1 %}{{ m.role | upper }}: "
                "{{ m | tojson(separators=(',', ':')) }}\n{% generation %}{{ m.content }}{% endgeneration %}"
                "{% if m.role == 'user' %}{% continue %}{% endif %} [{{ ns.n }}] {{ dict(a=1) | tojson }}\n"
                "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ eos_token }}")
    msgs = [{"role": "system", "content": "be brief, é <|im_end|>"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    for source in (KIMI_TEMPLATE, features):
        want = render_jinja_template([msgs], chat_template=source, add_generation_prompt=True, bos_token="[BOS]",
                                     eos_token="[EOS]")[0][0]
        assert ChatTemplate(source, "[BOS]", "[EOS]").render(msgs) == want
    for source, error in (("{{ ''.__class__.__mro__ }}", "SecurityError"), ("{{ messages.append(1) }}", "Security"),
                          ("{% set ns = namespace(_x=1) %}", "underscore"), ("{{ x.y }}", "UndefinedError"),
                          ("{{ raise_exception('no system turn') }}", "^no system turn$")):
        with pytest.raises(TemplateFailed, match=error):
            ChatTemplate(source, None, None).render(msgs)
    with pytest.raises(ValueError, match=r"chat template does not compile: .* \(line 2\)"):
        ChatTemplate("hi\n{% for %}", None, None)


def test_concurrent_requests_batch_and_stay_lossless(servers, engine):
    """Seven requests at once (prompts as token ids, other lengths and speculation modes, budget auto:4 among
    them: its lane measures a cost curve on first use) through 4 slots: each equals its own greedy decode;
    requests joined and left the batch between rounds."""
    main, _ = servers
    rng = random.Random(3)
    jobs = [([rng.randrange(1000) for _ in range(n)], spec, budget)
            for n, spec, budget in ((3, "ddtree", 8), (11, "ddtree", 8), (40, "none", 8), (7, "chain", 8),
                                    (5, "ddtree", 4), (2, "ddtree", 8), (6, "ddtree", "auto:4"))]
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        ids, spec, budget = jobs[i]
        r = _client(main).completions.create(model="kimi-hf", prompt=ids, max_tokens=20 + 3 * i, temperature=0,
                                             stream=True, extra_body={"return_token_ids": True, "spec": spec,
                                                                      "budget": budget})
        out[i] = _stream_text(r)[1]

    rounds_before = main.metric("kdtree_request_rounds_total")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (ids, _, _) in enumerate(jobs):
        assert out.get(i) == list(engine.generate_ids(ids, 20 + 3 * i)), i
    assert main.metric("kdtree_request_rounds_total") > rounds_before
    assert main.metric("kdtree_running") == 0 and main.metric("kdtree_queue_depth") == 0


def test_stop_strings_and_stop_ids(servers, engine):
    main, _ = servers
    client = _client(main)
    free = "".join(engine.generate(PROMPT, 40))
    stop = free[len(free) // 2:len(free) // 2 + 3]
    want = "".join(engine.generate(PROMPT, 40, stop=[stop]))
    got = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop" and stop not in want
    text, _, finish, _ = _stream_text(client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=40,
                                                                temperature=0, stop=stop, stream=True))
    assert (text, finish) == (want, "stop")
    ids = list(engine.generate_ids(PROMPT, 40))
    cut = ids.index(ids[10]) + 1  # the first occurrence of the 11th token ends it
    got = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"stop_token_ids": [ids[10]], "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == ids[:cut] and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(servers, engine):
    """Sampled requests at once (one batch: each row samples from its own seed and temperature): each
    equals `kdtree run --seed` alone; the same seed twice, the same tokens; another seed, others."""
    main, _ = servers
    client = _client(main)
    jobs = [(7, 0.9), (7, 0.9), (8, 0.9), (7, 0.5)]
    out: dict[int, list[int]] = {}

    def sample(i: int) -> None:
        seed, temp = jobs[i]
        r = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=24, temperature=temp, seed=seed,
                                      extra_body={"return_token_ids": True})
        out[i] = r.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=sample, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (seed, temp) in enumerate(jobs):
        assert out.get(i) == list(engine.generate_ids(PROMPT, 24, temperature=temp, seed=seed)), i
    assert out[0] == out[1] and out[0] != out[2] and out[0] != list(engine.generate_ids(PROMPT, 24))


def test_sampled_requests_share_one_batch(engine):
    """In process: three seeded requests (other prompts, seeds, temperatures) are queued before the
    scheduler starts, so they take rows of one sampled lane at its first boundary; a fourth joins once
    the first has tokens.  Each samples what it samples alone, and one seed again alone draws the same."""
    lanes = LocalLanes(engine, 4, 256)
    sched = Scheduler(lanes, 4, 4, Metrics("m"))
    reqs = [([5, 6, 7], 3, 0.8), ([9, 10, 11, 12, 13], 4, 1.0), ([5, 6, 7], 11, 0.6), ([20, 21], 3, 0.8)]

    def job(loop, prompt: list[int], seed: int, temp: float) -> Job:
        params = SamplingParams(20, temp, seed, engine.stop_ids()[0])
        return Job(Generation(prompt, params, SpecConfig("ddtree", 8), (), False, True, False, True, "m"), loop)

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        jobs = [job(loop, *r) for r in reqs[:3]]
        for j in jobs:
            sched.submit(j)
        sched.start()
        times: list[float] = []
        reading = [asyncio.create_task(read_events(j, times if i == 0 else [])) for i, j in enumerate(jobs)]
        while len(times) < 2 and not reading[0].done():
            await asyncio.sleep(0.001)
        late = job(loop, *reqs[3])
        sched.submit(late)
        return await asyncio.gather(*reading, read_events(late, []))

    try:
        got = asyncio.run(run())
    finally:
        sched.close()
    key = ("ddtree", 8, False, False)  # (mode, budget, auto, greedy)
    assert list(lanes.lanes) == [key] and lanes.lanes[key].session.batch == 4
    assert got == [list(engine.generate_ids(p, 20, temperature=temp, seed=seed)) for p, seed, temp in reqs]
    assert got[0] != got[2] and got[0] != list(engine.generate_ids([5, 6, 7], 20))


def test_bad_requests_get_openai_errors(servers):
    main, _ = servers
    client = _client(main)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 160") as e:
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=200, temperature=0)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.completions.create(model="kimi-hf", prompt=list(range(161)), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="top_p is not supported") as e:
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4, top_p=0.5)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="kimi-hf", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4, temperature=-1)
    for bad in ("many", True, 2.5, "auto:x"):
        with pytest.raises(openai.BadRequestError, match="budget must be an integer, auto or auto:N") as e:
            client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4, extra_body={"budget": bad})
        assert e.value.body["param"] == "budget"
    with pytest.raises(openai.BadRequestError, match="budget auto applies to spec ddtree"):
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4,
                                  extra_body={"spec": "chain", "budget": "auto"})
    with pytest.raises(openai.BadRequestError, match="spec must be none, chain or ddtree"):
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4, extra_body={"spec": "beam"})
    with pytest.raises(openai.BadRequestError, match=r"outside the vocabulary"):
        client.completions.create(model="kimi-hf", prompt=[5, 10 ** 7], max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        _client(main, key="wrong").completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4)
    r = httpx.post(main.v1 + "/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(main.v1 + "/models").status_code == 401


def test_health_models_metrics(servers):
    main, _ = servers
    assert main.get("/health").json() == {"status": "ok"}
    models = _client(main).models.list()
    assert [m.id for m in models.data] == ["kimi-hf"]
    text = main.get("/metrics").text
    for name in ("kdtree_requests_total", "kdtree_generation_tokens_total", "kdtree_tau", "kdtree_queue_depth",
                 "kdtree_round_seconds_bucket", "kdtree_round_seconds_count"):
        assert name in text
    assert main.metric("kdtree_generation_tokens_total") > 0 and main.metric("kdtree_tau") >= 1.0


def test_queue_full_429_and_disconnect_frees_the_slot(servers):
    """One slot, a queue of one: a long stream holds the slot, a second request waits, a third gets
    429; the first client disconnects mid-stream, and the waiting request takes the slot."""
    _, small = servers
    client = _client(small)
    cancelled = small.metric("kdtree_requests_total")

    first = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=1000, temperature=0, stream=True)
    next(iter(first))
    small.wait_metric("kdtree_running", 1)
    second_started = threading.Event()
    second_text: list[str] = []

    def second() -> None:
        s = client.completions.create(model="kimi-hf", prompt="hi", max_tokens=5, temperature=0, stream=True)
        for ch in s:
            second_started.set()
            second_text.append(ch.choices[0].text if ch.choices else "")

    t = threading.Thread(target=second)
    t.start()
    small.wait_metric("kdtree_queue_depth", 1)
    with pytest.raises(openai.RateLimitError, match="busy"):
        client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=4, temperature=0)
    assert not second_started.is_set()
    first.close()  # the client goes away mid-stream
    t.join(60)
    assert second_started.is_set() and small.metric("kdtree_requests_total") == cancelled + 2
    small.wait_metric("kdtree_running", 0)
    lines = small.get("/metrics").text.splitlines()
    assert any('outcome="cancelled"} 1' in line for line in lines), lines


def test_short_load_completes_or_errors_cleanly(servers):
    """benchmarks/serve_load.py's driver against the one-slot server: 3 clients for 3 s; every
    request completes or gets a clean 429, none hangs."""
    _, small = servers
    res = asyncio.run(drive(small.base, clients=3, seconds=3, max_tokens=8, stall_s=30))
    assert res["hung"] == 0 and res["completed"] >= 2 and set(res["errors"]) <= {"429"}, res
    assert res["requests"] == res["completed"] + sum(res["errors"].values())
    small.wait_metric("kdtree_running", 0)


def test_tp2_serves_the_same_tokens_and_a_dead_rank_gives_503(paths, engine):
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"--tp 2 on cuda needs two GPUs, this machine has {torch.cuda.device_count()}")
    path, _ = paths
    srv = ServerProcess(path, "--tp", "2", "--max-model-len", "256", *ON_DEVICE,
                        env={**ONE_THREAD, "KDTREE_FAULT_RANK": "1", "KDTREE_FAULT_AT": "300"})
    try:
        srv.wait()
        client = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == list(engine.generate_ids(PROMPT, 8))
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="rank 1 died") as e:  # 503
            client.completions.create(model="kimi-hf", prompt=PROMPT, max_tokens=200, temperature=0)
        assert e.value.status_code == 503 and time.monotonic() - t0 < 60
        assert srv.exit_code() == 1
        errors = [line for line in srv.err if line.startswith("error:")]
        assert len(errors) == 1 and "rank 1 died" in errors[0], srv.err
    finally:
        srv.stop()


def test_a_long_prompt_joins_in_chunks_between_rounds(engine):
    """In process (the server's scheduler, ddtree): a 900-token prompt joins while a stream runs.  With
    the default prefill budget the stream gets a round between its chunks (256 tokens each); with whole
    prompts at once, none.  Both requests' tokens equal the engine's either way."""
    stops = engine.stop_ids()[0]
    prompt = [random.Random(5).randrange(1000) for _ in range(900)]
    chunked = join_stall(engine, prompt, PREFILL_CHUNK, 1024, max_tokens=40, stop_ids=stops)
    whole = join_stall(engine, prompt, None, 1024, max_tokens=40, stop_ids=stops)
    stream = list(engine.generate_ids(SHORT, 40))
    assert len(stream) == 40  # the stream outlives the join
    assert chunked["tokens"] == whole["tokens"] == {"stream": stream, "long": list(engine.generate_ids(prompt, 4))}
    assert chunked["stream_rounds_during_join"] >= 3 and whole["stream_rounds_during_join"] <= 1, (chunked, whole)
