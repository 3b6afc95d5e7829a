"""`stagewise serve`: an OpenAI-compatible HTTP server over any streaming stage (04+).

    stagewise serve --stage 9 --model smollm2-135m --host 127.0.0.1 --port 8000   (common/serve/server.py)

FastAPI + uvicorn (the stack vLLM and SGLang use) in front of the stage's `SchedulerManager`:
the event loop only parses, validates and writes bytes; the manager's worker thread runs the
model, as it does in-process. The worker's put on a request's queue wakes the event loop (a
listener on the handle), which drains it without blocking: no thread per request, and a slow
client never stalls the worker (its chunks wait in its queue). With `--engine-process` the
manager runs in a process of its own, and the server holds an `EngineProcess` that hands out
the same handles (common/serve/engine_process.py).
A dropped client cancels its request (its KV blocks go back to the pool); SIGINT/SIGTERM end
every in-flight request, answer 503 to new ones, and release the port.
The stage comes from the registry (common/stages.py): this file imports no stage.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.serve.engine_process import call_beside, check_health, engine_stats
from common.serve.transport import CancelOnDisconnect, EventStream
from common.serve.protocol import (APIError, ParsedRequest, StopMatcher, check_model, choice, envelope, new_id, parse_chat, parse_completion, parse_json, sse, text_event, tokens_through, usage)
from common.requests import ContextLengthExceeded
from common.tokenizer import LONG_TEXT
from common.serve.metrics import ServeMetrics
from common.serve.tokenization import add_tokenize_routes

SHUTTING_DOWN = "the server is shutting down"
# OpenAI's answer to a missing or wrong key; /health and /metrics stay open, as in vLLM
UNAUTHORIZED = APIError(401, "invalid API key: send the server's --api-key as `Authorization: Bearer <key>`",
                        code="invalid_api_key")


@dataclass
class Delta:
    """Text to send, and at the end why the request stopped and its token counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ServeState:
    """What the endpoints share: the manager, the model's name, the API key, the metrics and whether we are shutting down."""

    def __init__(self, manager: Any, model_name: str, stage: str, api_key: str | None = None) -> None:
        self.manager = manager
        self.model_name = model_name
        self.stage = stage
        # `Authorization: Bearer <api_key>` on every /v1/ path when set (vLLM's --api-key)
        self.bearer = None if api_key is None else b"Bearer " + api_key.encode()
        self.tokenizer = manager.engine.tokenizer
        self.max_model_len = int(manager.engine.max_model_len)
        self.vocab_size = len(self.tokenizer)  # token-id prompts are checked against it
        self.shutting_down = False
        self.metrics = ServeMetrics()  # GET /metrics; counted on the event loop, in generate()
        self._closed = threading.Event()
        self._to_submit: list[tuple[ParsedRequest, asyncio.Future]] = []  # parsed this loop iteration

    def submit(self, req: ParsedRequest) -> "asyncio.Future[Any]":
        """add_request, deferred to the end of this event-loop iteration with every other request
        parsed in it, so requests that arrive together reach the worker together and can share
        one batched prefill. It adds no wait: the callback runs as soon as the loop is free."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._to_submit.append((req, future))
        if len(self._to_submit) == 1:
            loop.call_soon(self._submit_all)
        return future

    def _submit_all(self) -> None:
        batch, self._to_submit = self._to_submit, []
        for req, future in batch:
            if future.cancelled():  # its client left before it was submitted
                continue
            if req.prompt is not None and len(req.prompt) > LONG_TEXT:
                self._submit_in_thread(req, future)
                continue
            try:
                future.set_result(self._add(req))
            except Exception as exc:
                future.set_exception(exc)

    def _add(self, req: ParsedRequest) -> Any:
        return self.manager.add_request(req.prompt, prompt_token_ids=req.prompt_token_ids, params=req.params)

    def _submit_in_thread(self, req: ParsedRequest, future: asyncio.Future) -> None:
        """add_request in a thread, for a prompt long to tokenize (add_request's caller tokenizes,
        unless --tokenize-workers): on the event loop, a prompt of megabytes would stall every
        stream for seconds. The loop serves the others meanwhile, as vLLM's tokenizes off its loop."""
        work = asyncio.get_running_loop().run_in_executor(None, self._add, req)

        def hand_over(work: asyncio.Future) -> None:
            if future.cancelled():  # its client left meanwhile: stop the request it made
                if not work.cancelled() and work.exception() is None:
                    work.result().cancel()
            elif work.exception() is not None:
                future.set_exception(work.exception())
            else:
                future.set_result(work.result())

        work.add_done_callback(hand_over)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end the in-flight ones (the manager cancels them). Idempotent."""
        if self.shutting_down:
            return
        self.shutting_down = True
        # close() joins the worker (up to one decode step): off the signal handler's thread.
        threading.Thread(target=self._close, name="stagewise-serve-close", daemon=True).start()

    def _close(self) -> None:
        self.manager.close()  # every handle ends, so every stream gets its end
        self._closed.set()

    def wait_closed(self, timeout: float) -> bool:
        return self._closed.wait(timeout)

    def check_health(self) -> "Future[dict | None]":
        """The KV pool's free and total blocks, or why the engine can run no more steps, asked of
        the engine wherever it runs (a Future: an engine in its own process answers over its
        pipe, and the event loop must not wait)."""
        return call_beside(self.manager, check_health)

    def engine_stats(self) -> "Future[dict]":
        """The KV pool and the engine's counters (`engine_stats`), asked as check_health is, for /metrics."""
        return call_beside(self.manager, engine_stats)


def _wake_on_put(handle: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set (on the loop) whenever the worker puts something on the request's queue."""
    ready = asyncio.Event()

    def on_put() -> None:  # in the worker's thread: hand over, never raise
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:  # the loop is closed (server stopped): nobody is waiting
            pass

    handle.set_listener(on_put)
    return ready


def _api_error(exc: BaseException, req: ParsedRequest) -> APIError:
    if isinstance(exc, APIError):
        return exc
    # The engine names our fields; the answer names the request's own (`messages` for a chat, `max_completion_tokens`).
    names = {"prompt": req.prompt_field, "max_new_tokens": req.max_tokens_field}
    if isinstance(exc, ContextLengthExceeded):  # OpenAI's code for it
        name = names[exc.field]
        return APIError(400, f"{name} {exc.detail}", param=name, code="context_length_exceeded")
    # Bad input only the engine sees: a prompt the KV pool can never hold (or not text), a request that
    # grew past the whole pool (it asked for more tokens than the pool holds). The message starts with
    # the field's name.
    if isinstance(exc, ValueError):
        text = str(exc)
        for field, name in names.items():
            if text.startswith(field):
                return APIError(400, name + text[len(field):], param=name, code="invalid_value")
        return APIError(400, text, code="invalid_value")
    return APIError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


async def generate(state: ServeState, req: ParsedRequest) -> AsyncIterator[Delta]:
    """One request through the manager, as text deltas; the last one carries finish_reason.

    Closing this generator early (client gone) cancels the request, so its blocks are freed.
    A stop string ends the request at the match: it is cancelled, and we wait for the manager
    to confirm, so the blocks are back in the pool before the client hears "stop".
    """
    if state.shutting_down:
        raise APIError(503, SHUTTING_DOWN, type_="service_unavailable")
    metrics = state.metrics
    tracked = metrics.start()
    submitted = state.submit(req)
    try:
        handle = await submitted
    except asyncio.CancelledError:  # the client left just as the request was submitted: stop it
        if submitted.done() and not submitted.cancelled() and submitted.exception() is None:
            submitted.result().cancel()
        metrics.end(tracked, "abort")
        raise
    except RuntimeError as exc:  # closed between the check and the call, or the engine's process has ended
        metrics.end(tracked, None)
        why = f"{SHUTTING_DOWN} ({exc})" if state.shutting_down else str(exc)
        raise APIError(503, why, type_="service_unavailable") from None
    except BaseException:  # refused by add_request (bad input only the engine sees)
        metrics.end(tracked, None)
        raise
    ready = _wake_on_put(handle, asyncio.get_running_loop())
    matcher, n_tokens, ended, stopped = StopMatcher(req.stop), 0, False, False
    sent_ids, sent_chars = [], 0  # kept only with stop strings: to count the tokens up to a match
    try:
        while True:
            await ready.wait()
            ready.clear()  # before draining: a put from here on sets it again
            chunks, result = handle.drain()
            if chunks and tracked.first_token is None:
                metrics.first_token(tracked)
            for chunk in chunks:
                if stopped:
                    break  # tokens decoded before the cancel landed: not part of the answer
                text, stopped = matcher.feed(chunk.text)
                if stopped:
                    handle.cancel()
                    n_tokens += 1 if len(chunk.token_ids) == 1 else tokens_through(
                        state.tokenizer, sent_ids + chunk.token_ids, sent_chars + matcher.end) - len(sent_ids)
                else:
                    n_tokens += len(chunk.token_ids)
                    if req.stop:
                        sent_ids += chunk.token_ids
                        sent_chars += len(chunk.text)
                if text or not stopped:
                    yield Delta(text)
            if result is None:
                continue
            ended = True
            if isinstance(result, BaseException):
                metrics.end(tracked, None, completion_tokens=n_tokens)
                raise _api_error(result, req)
            if result.finish_reason == "cancelled" and not stopped:
                metrics.end(tracked, None, completion_tokens=n_tokens)
                raise APIError(503, f"{SHUTTING_DOWN}: request cancelled", type_="service_unavailable")
            reason = "stop" if stopped else result.finish_reason
            n = n_tokens if stopped else len(result.token_ids)
            metrics.end(tracked, reason, len(result.prompt_token_ids), n)
            yield Delta(matcher.flush(), reason, len(result.prompt_token_ids), n)
            return
    finally:
        if not ended:
            handle.cancel()
            metrics.end(tracked, "abort", completion_tokens=n_tokens)


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
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json(APIError(exc.status_code, str(exc.detail), type_=kind).body(), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        # A bug on one of FastAPI's routes (/tokenize, /metrics, ...): OpenAI's shape, as the
        # generation routes answer theirs. Starlette raises it again afterwards, so uvicorn logs it.
        return _json(APIError(500, f"{type(exc).__name__}: {exc}", type_="internal_error").body(), 500)

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
        response = None
        try:
            if scope["method"] != "POST":
                return await _json(APIError(405, "Method Not Allowed").body(), 405, {"Allow": "POST"})(scope, receive, send)
            state = self.state
            body = parse_json(await read_body(receive))
            req = (parse_chat(body, state.tokenizer, state.max_model_len) if chat
                   else parse_completion(body, state.vocab_size))
            # A client that leaves before its answer starts (waiting in the queue, in its prefill, or
            # for a whole response) cancels its request there, as vLLM's with_cancellation does:
            # generate()'s finally frees its place. A stream's EventStream watches on from its first chunk.
            async with CancelOnDisconnect(receive):
                response = await _respond(state, req, chat)
            if response is None:
                return  # the client is gone: nobody to answer
        except APIError as exc:
            response = _json(exc.body(), exc.status)
        except ClientDisconnect:  # gone before its body arrived: nothing was submitted, nobody to answer
            return
        except Exception as exc:  # a bug: answer in OpenAI's shape, and say what it was in the log
            logging.getLogger("stagewise.serve").exception("request failed")
            response = _json(APIError(500, f"{type(exc).__name__}: {exc}", type_="internal_error").body(), 500)
        await response(scope, receive, send)
