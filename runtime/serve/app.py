"""The ASGI app (FastAPI): OpenAI's routes over a Scheduler.

  POST /v1/completions, /v1/chat/completions   JSON answer, or server-sent events with stream: true
  GET  /v1/models, /health, /metrics           /health: 200, or 503 once the engine failed

Errors are OpenAI's error JSON ({"error": {message, type, param, code}}) with status 400 (bad
request), 401 (--api-key set and no matching bearer token on /v1/*), 404 (another model), 429
(queue full) or 503 (the engine failed).  A streamed request whose client disconnects is cancelled:
its row is freed at the next round boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from core.tokenizer import Tokenizer
from runtime.decode.params import SpecConfig
from runtime.serve.chat import ChatPrompt
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import (
    ApiError,
    Generation,
    answer,
    choice,
    chunk,
    parse,
    usage,
)
from runtime.serve.scheduler import Job, Scheduler
from runtime.serve.text import TextStream


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the served model name
    max_model_len: int  # prompt + max_tokens
    spec: SpecConfig  # the default speculation mode and budget
    has_drafter: bool
    stop_ids: tuple[int, ...]  # eos, <|im_end|>, config eos: always stop
    vocab: int
    api_key: str | None = None


def build_app(cfg: ServeConfig, tok: Tokenizer, scheduler: Scheduler, metrics: Metrics) -> FastAPI:
    """The app; compiles the tokenizer's chat template (a ValueError when it does not parse)."""
    chat_prompt = ChatPrompt(tok)
    app = FastAPI(title="kdtree serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.middleware("http")
    async def bearer(request: Request, call_next):
        if cfg.api_key is not None and request.url.path.startswith("/v1/"):
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {cfg.api_key}".encode()):
                err = ApiError(401, "missing or wrong API key: send `Authorization: Bearer KEY` (--api-key)",
                               code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if scheduler.dead is not None:
            return JSONResponse(ApiError(503, scheduler.dead).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "kdtree", "max_model_len": cfg.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < cfg.vocab]
            if bad:
                raise ApiError(400, f"prompt ids {bad[:5]} outside the vocabulary [0, {cfg.vocab})", "prompt")
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt: n = 1)", "prompt")
        if not ids:
            raise ApiError(400, "prompt is empty: give at least one token", "prompt")
        return await _generate(request, _parse(body, ids, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        return await _generate(request, _parse(body, chat_prompt.ids(body.get("messages")), chat=True))

    def _parse(body: dict, ids: list[int], chat: bool) -> Generation:
        g = parse(body, ids, chat, cfg.model, cfg.stop_ids, cfg.max_model_len, cfg.spec, cfg.vocab)
        if g.spec.mode != "none" and not cfg.has_drafter:
            raise ApiError(400, f"spec {g.spec.mode!r} needs a drafter: start the server with --drafter", "spec")
        return g

    async def _generate(request: Request, g: Generation):
        job = Job(g, asyncio.get_running_loop())
        scheduler.submit(job)
        if g.stream:
            return StreamingResponse(_events(job), media_type="text/event-stream")
        try:
            text, ids, finish = [], [], None
            async for piece, new_ids, finish in _pieces(job):
                text.append(piece)
                ids += new_ids
        finally:
            scheduler.cancel(job)  # a no-op once finished; frees the row if this handler is cancelled
        return answer(g, "".join(text), finish, ids)

    async def _pieces(job: Job):
        """(text, ids, finish_reason | None) as the request's tokens arrive; ends after the last."""
        g = job.gen
        stream = TextStream(tok, g.params.stop_ids, g.stop_texts)
        while True:
            kind, payload = await job.events.get()
            if kind == "error":
                raise payload
            if kind == "tokens":
                text = stream.push(payload)
                if stream.stopped:  # a stop string: end it here (the row is freed at the next boundary)
                    scheduler.cancel(job, "stop")
                    yield text, payload, "stop"
                    return
                yield text, payload, None
            else:
                yield stream.finish(), [], payload
                return

    async def _events(job: Job):
        g, sent = job.gen, 0
        try:
            if g.chat:
                yield _sse(chunk(g, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]))
            try:
                async for text, ids, finish in _pieces(job):
                    sent += len(ids)
                    if text or ids or finish:
                        yield _sse(chunk(g, [choice(g, text, finish, ids, delta=True)]))
            except ApiError as exc:  # the status line is gone: the error travels as an event
                yield _sse(exc.body())
                return
            if g.include_usage:
                yield _sse(chunk(g, [], usage(g, sent)))
            yield "data: [DONE]\n\n"
        finally:
            scheduler.cancel(job)  # the client went away (or the stream ended): free the row

    return app


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
