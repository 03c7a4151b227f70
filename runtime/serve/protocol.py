"""OpenAI request and response shapes: a request body validated into a Generation, the JSON answers,
the stream's chunks, and OpenAI's error JSON.

Fields honoured (both endpoints): `max_tokens` (chat: also `max_completion_tokens`), `temperature`
(OpenAI's default 1.0), `seed` (a random one when absent), `stop` (a string or a list of strings and
token ids), `stop_token_ids` (vLLM's), `n` = 1, `stream`, `stream_options.include_usage`, `model`;
this engine's extras: `spec` (none | chain | ddtree) and `budget` (DDTree nodes per round: an integer, or
"auto" / "auto:N" to let each round choose its tree size on the device, runtime/decode/budget.py), and
`return_token_ids` (each choice then carries the generated ids, the stop token included, as
`kdtree run --json` prints them).  `/v1/completions` takes `prompt` as text or as a list of token
ids; `/v1/chat/completions` takes `messages` (runtime/serve/chat.py).  A field the sampler cannot
honour (top_p != 1, penalties, logprobs, logit_bias, best_of, echo, suffix, tools) is a 400 naming it.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field

from runtime.decode.params import InvalidParam, SamplingParams, SpecConfig

# field -> the value that means "off" (the sampler honours nothing else)
UNSUPPORTED = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": None, "top_logprobs": None,
               "logit_bias": None, "best_of": 1, "echo": False, "suffix": None, "tools": None, "functions": None,
               "response_format": None, "top_k": -1, "min_p": 0, "repetition_penalty": 1}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable"}  # HTTP status -> OpenAI's error type


class ApiError(Exception):
    """An answer other than 200: HTTP status, OpenAI error type, message, the request field concerned."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class Generation:
    """One validated request: prompt ids, decode parameters, and what the answer must carry."""

    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecConfig
    stop_texts: tuple[str, ...]
    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, name: str, default, kind=float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    return kind(v)


def check_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v != off and not (v is False and off is None):
            raise ApiError(400, f"{name} is not supported by this server's sampler (got {v!r}; leave it unset)",
                           name)
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1, got {n!r}", "n")


def stops(body: dict, vocab: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`stop` (a string, or a list of strings and ids) and `stop_token_ids` -> (ids, strings)."""
    raw = body.get("stop")
    items = [] if raw is None else [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise ApiError(400, f"stop must be a string or a list, got {raw!r}", "stop")
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list):
        raise ApiError(400, f"stop_token_ids must be a list of ids, got {extra!r}", "stop_token_ids")
    ids, texts = [], []
    for s in items + extra:
        if isinstance(s, str) and s:
            texts.append(s)
        elif isinstance(s, int) and not isinstance(s, bool) and 0 <= s < vocab:
            ids.append(s)
        else:
            raise ApiError(400, f"stop entries must be non-empty strings or token ids in [0, {vocab}), got {s!r}",
                           "stop")
    return tuple(ids), tuple(texts)


def parse(body, prompt_ids: list[int], chat: bool, model: str, default_ids: tuple[int, ...], max_model_len: int,
          default_spec: SpecConfig, vocab: int) -> Generation:
    """A request body (with its prompt already encoded) -> Generation, or ApiError 400 naming the field."""
    check_unsupported(body)
    if body.get("model") not in (None, model):
        raise ApiError(404, f"model {body.get('model')!r} is not served here; this server serves {model!r}",
                       "model", "model_not_found")
    room = max_model_len - len(prompt_ids)
    if room < 0 or (room == 0 and chat):
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{len(prompt_ids)}", "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, room if chat else min(16, room), int)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt "
                            f"({len(prompt_ids)}) + {name} ({max_tokens}) exceed it", name, "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0)
    seed = _number(body, "seed", None, int)
    stop_ids, stop_texts = stops(body, vocab)
    ids = tuple(sorted(set(default_ids) | set(stop_ids)))
    spec_mode = body.get("spec", default_spec.mode)
    budget = body.get("budget")
    if budget is None:  # the server's default budget (auto included) where it applies, i.e. to ddtree
        budget = default_spec.budget_label if spec_mode == "ddtree" else default_spec.budget
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ApiError(400, f"budget must be an integer, auto or auto:N, got {budget!r}", "budget")
    opts = body.get("stream_options") or {}
    try:
        params = SamplingParams(max_tokens, temperature, secrets.randbits(62) if seed is None else seed, ids)
        spec = SpecConfig.of(spec_mode, budget)  # budget: B, "auto" or "auto:B_MAX" (chosen per round)
    except InvalidParam as exc:
        raise ApiError(400, str(exc).replace("max_new_tokens", name), exc.name.replace("max_new_tokens", name)) \
            from None
    return Generation(prompt_ids, params, spec, stop_texts, chat, bool(body.get("stream")),
                      bool(opts.get("include_usage")), bool(body.get("return_token_ids")), model)


def usage(g: Generation, completion_tokens: int) -> dict:
    p = len(g.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def choice(g: Generation, text: str, finish: str | None, token_ids: list[int] | None, delta: bool) -> dict:
    """One choice of an answer (delta: of a stream chunk)."""
    if g.chat:
        body = {"delta": {"content": text} if text or finish is None else {}} if delta else \
            {"message": {"role": "assistant", "content": text}}
    else:
        body = {"text": text, "logprobs": None}
    out = {"index": 0, **body, "finish_reason": finish}
    if token_ids is not None and g.return_token_ids:
        out["token_ids"] = token_ids
    return out


def answer(g: Generation, text: str, finish: str, token_ids: list[int]) -> dict:
    """The non-streamed answer."""
    kind = "chat.completion" if g.chat else "text_completion"
    return {"id": _id(g), "object": kind, "created": g.created, "model": g.model,
            "choices": [choice(g, text, finish, token_ids, delta=False)], "usage": usage(g, len(token_ids))}


def chunk(g: Generation, choices: list[dict], usage_: dict | None = None) -> dict:
    """One server-sent event's JSON (an empty choice list with usage: the final usage chunk)."""
    kind = "chat.completion.chunk" if g.chat else "text_completion"
    out = {"id": _id(g), "object": kind, "created": g.created, "model": g.model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def _id(g: Generation) -> str:
    return ("chatcmpl-" if g.chat else "cmpl-") + g.id
