"""`stagewise serve`: an OpenAI-compatible HTTP server over any streaming stage (04+).

    stagewise serve --stage 9 --model smollm2-135m --host 127.0.0.1 --port 8000   (common/serve/server.py)

FastAPI + uvicorn (the stack vLLM and SGLang use) in front of the stage's `SchedulerManager`:
the event loop only parses, validates and writes bytes; the manager's worker thread runs the
model, as it does in-process. The worker's put on a request's queue wakes the event loop (a
listener on the handle), which drains it without blocking: no thread per request, and a slow
client never stalls the worker (its chunks wait in its queue). With `--engine-process` the
manager runs in a process of its own, and the server holds an `EngineProcess` that hands out
the same handles (common/serve/engine_process.py). One request's way to the manager and back,
`generate`, lives in common/serve/generation.py; here are the routes and the responses.
A dropped client cancels its request (its KV blocks go back to the pool); SIGINT/SIGTERM end
every in-flight request, answer 503 to new ones, and release the port.
The stage comes from the registry (common/stages.py): this file imports no stage.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.serve.generation import SHUTTING_DOWN, Delta, ServeState, generate
from common.serve.transport import CancelOnDisconnect, EventStream
from common.serve.protocol import (APIError, ParsedRequest, check_model, choice, envelope, internal_error, new_id,
                                   parse_chat, parse_completion, parse_json, sse, text_event, usage)
from common.serve.tokenization import add_tokenize_routes

# OpenAI's answer to a missing or wrong key; /health and /metrics stay open, as in vLLM
UNAUTHORIZED = APIError(401, "invalid API key: send the server's --api-key as `Authorization: Bearer <key>`",
                        code="invalid_api_key")


async def _first(agen: AsyncIterator[Delta]) -> Delta:
    """The first delta, so that an error before any token is answered with its HTTP status."""
    return await agen.__anext__()


async def _collect(agen: AsyncIterator[Delta]) -> tuple[str, Delta]:
    """Drain a whole request (a client that leaves meanwhile cancels it: GenerationRoutes)."""
    parts: list[str] = []
    async for d in agen:
        parts.append(d.text)
        if d.finish_reason is not None:
            return "".join(parts), d
    raise APIError(500, "stream ended without a finish reason", type_="internal_error")


def _json(data: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, separators=(",", ":"), ensure_ascii=False), status_code=status,
                    headers=headers, media_type="application/json")


async def _respond(state: ServeState, req: ParsedRequest, chat: bool) -> Response:
    check_model(req.model, state.model_name)
    rid = new_id("chatcmpl" if chat else "cmpl")
    agen = generate(state, req)
    first = await _first(agen)  # errors before the first token keep their status (400, 503, ...)
    if not req.stream:
        async def again() -> AsyncIterator[Delta]:
            yield first
            async for d in agen:
                yield d
        text, last = await _collect(again()) if first.finish_reason is None else (first.text, first)
        body = envelope(chat, rid, state.model_name, [choice(chat, text, last.finish_reason, stream=False)], False)
        body["usage"] = usage(last.prompt_tokens, last.completion_tokens)
        return _json(body)

    created = int(time.time())
    text_chunk = text_event(chat, rid, state.model_name, created, req.include_usage)

    def chunk(choices: list[dict]) -> dict:  # every chunk but the usage one
        return envelope(chat, rid, state.model_name, choices, True, created, req.include_usage)

    async def events() -> AsyncGenerator[str, None]:
        is_first, d = True, first
        try:
            while True:
                # A finish rides on its own chunk, after the text, as OpenAI sends it.
                if is_first:
                    yield sse(chunk([choice(chat, d.text, None, True)]))
                    is_first = False
                elif d.text:
                    yield text_chunk(d.text)
                if d.finish_reason is not None:  # the finish, the usage and [DONE]: one write
                    last = [sse(chunk([choice(chat, "", d.finish_reason)]))]
                    if req.include_usage:
                        tail = envelope(chat, rid, state.model_name, [], True, created)
                        tail["usage"] = usage(d.prompt_tokens, d.completion_tokens)
                        last.append(sse(tail))
                    yield "".join(last) + sse("[DONE]")
                    return
                d = await agen.__anext__()
        except APIError as exc:  # mid-stream: the status line is sent; the error travels as an event
            yield sse(exc.body()) + sse("[DONE]")
        finally:
            await agen.aclose()

    return EventStream(events())


def build_app(state: ServeState) -> FastAPI:
    """`/health`, `/metrics`, `/tokenize`, `/detokenize`, `/v1/models` and FastAPI's answers to everything else (GenerationRoutes has the two POSTs)."""
    app = FastAPI(title="stagewise", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> Response:
        return _json(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _json(APIError(exc.status_code, str(exc.detail)).body(), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        # A bug on one of FastAPI's routes (/tokenize, /metrics, ...): OpenAI's shape, as the
        # generation routes answer theirs. Starlette raises it again afterwards, so uvicorn logs it.
        return _json(internal_error(exc).body(), 500)

    @app.get("/health")
    async def health() -> Response:
        if state.shutting_down:
            raise APIError(503, SHUTTING_DOWN, type_="service_unavailable")
        try:
            kv = await asyncio.wrap_future(state.check_health())
        except RuntimeError as exc:  # the engine's process has ended, or a rank of it: this server can answer nothing
            raise APIError(503, str(exc), type_="service_unavailable") from None
        return _json({"status": "ok", "stage": state.stage, "model": state.model_name, "kv_blocks": kv})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            engine = await asyncio.wrap_future(state.engine_stats())
        except RuntimeError:  # the engine's process has ended: what the server counted still stands
            engine = {}
        return Response(state.metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_tokenize_routes(app, state, _json)

    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "stagewise",
            "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [card]})

    @app.get("/v1/models/{model:path}")  # the OpenAI client's models.retrieve(name)
    async def model_card(model: str) -> Response:
        check_model(model, state.model_name)
        return _json(card)

    return app


async def read_body(receive: Any) -> bytes:
    """The request's body, straight from ASGI's receive (Starlette's Request.body() streams it
    through two more generators); ClientDisconnect if the client leaves first, as Starlette."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


class GenerationRoutes:
    """The ASGI app uvicorn runs: the two generation endpoints here, everything else FastAPI's.

    Why not `@app.post`: these two read their own JSON (so a bad field gets OpenAI's 400, not
    FastAPI's 422), and FastAPI's way to them is a stack of nine ASGI layers (error and
    exception middleware, body limit, telemetry, exit stack, router, request wrapper), each
    entered for the request and again for every chunk sent. A burst pays it 64 times over in
    its TTFT: the prefill starts only after the last request is parsed, and the median request's
    first token is written after half the others'. So the hot path is a plain ASGI call; the
    other routes (`/health`, `/v1/models`, unknown paths, wrong methods) and their error
    handling stay FastAPI's.
    """

    def __init__(self, state: ServeState) -> None:
        self.state = state
        self.app = build_app(state)
        self.routes = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat?

    def authorized(self, scope: Any) -> bool:
        """The request's `Authorization` header is the server's key (compared in constant time)."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.state.bearer)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        chat = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if self.state.bearer is not None and scope["type"] == "http" and scope["path"].startswith("/v1/") \
                and not self.authorized(scope):
            return await _json(UNAUTHORIZED.body(), UNAUTHORIZED.status)(scope, receive, send)
        if chat is None:
            return await self.app(scope, receive, send)
        try:
            if scope["method"] != "POST":
                return await _json(APIError(405, "Method Not Allowed").body(), 405, {"Allow": "POST"})(scope, receive, send)
            state = self.state
            body = parse_json(await read_body(receive))
            req = (parse_chat(body, state.tokenizer, state.max_model_len) if chat
                   else parse_completion(body, state.vocab_size))
        except APIError as exc:
            return await _json(exc.body(), exc.status)(scope, receive, send)
        except ClientDisconnect:  # gone before its body arrived: nothing was submitted, nobody to answer
            return
        except Exception as exc:
            return await _bug(exc)(scope, receive, send)
        # One watcher for the whole answer: a client that leaves while its request waits in the
        # queue, in its prefill or mid-answer cancels it there, as vLLM's with_cancellation does
        # (generate()'s finally frees its place); then there is nobody to answer.
        async with CancelOnDisconnect(receive):
            try:
                response = await _respond(state, req, chat)
            except APIError as exc:
                response = _json(exc.body(), exc.status)
            except Exception as exc:
                response = _bug(exc)
            await response(scope, receive, send)


def _bug(exc: Exception) -> Response:
    """A bug while answering: a 500 in OpenAI's shape, and what it was in the log."""
    logging.getLogger("stagewise.serve").exception("request failed")
    return _json(internal_error(exc).body(), 500)
