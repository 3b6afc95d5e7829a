"""`POST /tokenize` and `POST /detokenize` of `stagewise serve`, as vLLM's server has them.

A client counts a prompt's tokens before it sends it (will it fit the context window? how much
of the budget is left for `max_tokens`?) with the server's own tokenizer, not a copy that may
differ. So `/tokenize` encodes exactly as the engine does: a completion's `prompt` with
`common.tokenizer.encode` (no special tokens added, as the posts do), a chat's `messages` through
the same chat template as `/v1/chat/completions`. Its `count` is the `usage.prompt_tokens` that
request would report. Both answer on the event loop (a body of over `LONG_TEXT` bytes is
tokenized in a thread meanwhile): the engine is not involved.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from common.serve.protocol import bad_request, chat_prompt, check_fields, check_model, model_field, parse_json
from common.tokenizer import LONG_TEXT, encode

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _checked(body: dict, allowed: set[str], served: str) -> None:
    check_fields(body, allowed)  # the generation endpoints' own check: an unknown field is a 400
    check_model(model_field(body), served)


def tokenize(body: dict, tokenizer: Any, served: str, max_model_len: int) -> dict:
    """{"count", "max_model_len", "tokens"} (and "token_strs" when asked) for a prompt or messages."""
    _checked(body, TOKENIZE_FIELDS, served)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("prompt", "give a prompt (as /v1/completions) or messages (as /v1/chat/completions)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("prompt", f"must be a string, got {body['prompt']!r:.80}")
        field, text = "prompt", body["prompt"]
    else:
        add = body.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            raise bad_request("add_generation_prompt", f"must be true or false, got {add!r}")
        field, text = "messages", chat_prompt(body, tokenizer, add_generation_prompt=add)
    try:
        ids = encode(tokenizer, text)
    except ValueError as exc:  # not Unicode text (a lone surrogate): the completion would get this 400 too
        raise bad_request(field, str(exc)) from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(body: dict, tokenizer: Any, served: str) -> dict:
    """{"prompt": the text of `tokens`}."""
    _checked(body, DETOKENIZE_FIELDS, served)
    tokens, vocab = body.get("tokens"), len(tokenizer)
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise bad_request("tokens", f"must be a list of token ids in [0, {vocab})")
    return {"prompt": tokenizer.decode(tokens)}


def add_tokenize_routes(app: FastAPI, state: Any, json_response: Any) -> None:
    """The two routes on the server's FastAPI app (its APIError handler answers their errors)."""

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body arrived: nobody to answer (as the generation routes)
            return Response(status_code=204)
        body, args = parse_json(raw), (state.tokenizer, state.model_name, state.max_model_len)
        if len(raw) > LONG_TEXT:  # long to tokenize: in a thread, so the event loop serves the others meanwhile
            return json_response(await asyncio.get_running_loop().run_in_executor(None, tokenize, body, *args))
        return json_response(tokenize(body, *args))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=204)
        return json_response(detokenize(parse_json(raw), state.tokenizer, state.model_name))
