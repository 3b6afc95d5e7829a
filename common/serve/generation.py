"""One request's way from HTTP to the stage's manager and back, and what the endpoints share.

`ServeState` holds the manager, the model's name, the metrics and the shutdown flag; `generate`
turns one parsed request into text deltas: it submits the request (with the others parsed in
the same event-loop pass, so they can share a prefill), drains the handle whenever the worker
puts on it, applies stop strings, and cancels the request when its caller stops listening.
Apart from app.py (routes and responses) so that each reads on its own: this side knows the
manager and nothing of HTTP's wire.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator

from common.requests import ContextLengthExceeded
from common.serve.engine_process import call_beside, check_health, engine_stats
from common.serve.metrics import ServeMetrics
from common.serve.protocol import DETOKENIZE_CONTEXT, APIError, ParsedRequest, StopMatcher, internal_error, tokens_through
from common.tokenizer import LONG_TEXT

SHUTTING_DOWN = "the server is shutting down"


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
        # `Authorization: Bearer <api_key>` on every /v1/ path when set (vLLM's --api-key); an empty
        # key is none, as vLLM reads it (and as our clients send it: no header)
        self.bearer = b"Bearer " + api_key.encode() if api_key else None
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
        """The request's handle from the manager (which tokenizes a text prompt, or its workers do)."""
        return self.manager.add_request(req.prompt, prompt_token_ids=req.prompt_token_ids, params=req.params)

    def _submit_in_thread(self, req: ParsedRequest, future: asyncio.Future) -> None:
        """add_request in a thread, for a prompt long to tokenize (add_request's caller tokenizes,
        unless --tokenize-workers): on the event loop, a prompt of megabytes would stall every
        stream for seconds. The loop serves the others meanwhile, as vLLM's tokenizes off its loop."""
        def add_unless_gone() -> Any:
            return None if future.cancelled() else self._add(req)  # its client may have left while it queued

        def hand_over(done: asyncio.Future) -> None:
            handle = None if done.cancelled() or done.exception() is not None else done.result()
            if future.cancelled():  # its client left meanwhile: stop the request it made
                if handle is not None:
                    handle.cancel()
            elif done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(handle)

        asyncio.get_running_loop().run_in_executor(None, add_unless_gone).add_done_callback(hand_over)

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
    return internal_error(exc)


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
    context: list[int] = []  # the last ids sent, with stop strings only: tokens_through's context
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
                    n_tokens += tokens_through(state.tokenizer, context, chunk.token_ids, matcher.end)
                else:
                    n_tokens += len(chunk.token_ids)
                    if req.stop:
                        context = (context + chunk.token_ids)[-DETOKENIZE_CONTEXT:]
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
