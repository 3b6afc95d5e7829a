"""The OpenAI API's request and response shapes, as `stagewise serve` speaks them.

Why a module of its own: the server (common/serve/app.py) should read as "HTTP in, SchedulerManager
out"; everything about what a field may hold, how a refusal is worded and what a chunk looks
like lives here, testable without a socket. Anything the engine cannot honour (n other than 1, logprobs,
tools, penalties, unknown fields) is refused with a 400 naming the field: a client that asked
for it must not get an answer that silently ignored it.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # json.dumps' own string encoder (C) with ensure_ascii=False
from typing import Any, Callable

from common.requests import SamplingParams, _is_int, _is_real
from common.tokenizer import IncrementalDetokenizer

# Fields each endpoint understands. Anything else is refused by name.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "ignore_eos", "n", "presence_penalty", "frequency_penalty", "logit_bias",
           "user", "logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "functions", "function_call", "response_format", "parallel_tool_calls"}
# Accepted only at the value that means "off"; anything else would change the answer in a way we cannot.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, False, True), "logit_bias": (None, {}),
}
_WHY_OFF = {"n": "only n = 1 is supported: send n requests for n answers", "best_of": "only best_of = 1 is supported",
            "echo": "echo is not supported", "suffix": "suffix (insertion) is not supported",
            "logprobs": "logprobs are not supported", "top_logprobs": "logprobs are not supported",
            "presence_penalty": "presence_penalty is not supported", "logit_bias": "logit_bias is not supported",
            "frequency_penalty": "frequency_penalty is not supported", "tools": "tools are not supported",
            "functions": "functions are not supported", "tool_choice": "tool calls are not supported",
            "function_call": "function calls are not supported"}
_ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": _utf8(self.message), "type": self.type, "param": _utf8(self.param), "code": self.code}}


def _utf8(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a field name echoed back from the request's JSON may hold a
    lone surrogate (`"\\ud800"` is valid JSON, not valid UTF-8); it is sent as its escape."""
    if text is None:
        return None
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def internal_error(exc: BaseException) -> APIError:
    """A bug's 500, in OpenAI's shape, saying what it was."""
    return APIError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


def bad_request(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class ParsedRequest:
    """One validated request, ready for SchedulerManager.add_request."""

    model: str | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    # The request's own names for what the engine calls "prompt" and "max_new_tokens", for a
    # refusal only the engine can make (the prompt's token count is known after tokenization).
    prompt_field: str = "prompt"
    max_tokens_field: str = "max_tokens"


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise APIError(400, f"malformed JSON body: {type(exc).__name__}: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise APIError(400, f"{name}: unsupported field", param=name, code="unsupported_field")
    for name, off in _OFF_VALUES.items():
        if name in body and not _is_off(body[name], off):
            value = body[name]
            raise APIError(400, f"{name}: {_WHY_OFF.get(name, 'unsupported value')} (got {value!r:.80})",
                           param=name, code="unsupported_value")


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """None, or one of `off` of the same kind (False is not 0; 0.0 is 0; [] is off only for a
    field whose type is a list, so `n: []` is refused as OpenAI refuses it). `logprobs: 0` is not
    off: on /v1/completions it asks for the sampled tokens' logprobs."""
    if value is None:
        return True
    for v in off:
        if isinstance(value, bool) or isinstance(v, bool):
            if value is v:
                return True
        elif _is_real(value) and _is_real(v):
            if value == v:
                return True
        elif type(value) is type(v) and value == v:  # a string, [] or {}
            return True
    return False


def _int_field(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise bad_request(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _sampling(body: dict, max_tokens_field: str, default_max_tokens: int) -> SamplingParams:
    """OpenAI's sampling fields as SamplingParams; temperature 0 is greedy, as in the API.

    What does not fit the context window is refused, as OpenAI's API does: a prompt that leaves
    no room, and a `max_tokens` the client gave that reaches past it. A default `max_tokens` is
    ours, not the client's: it ends where the window does."""
    max_tokens = _int_field(body, max_tokens_field, 1)
    temperature = body.get("temperature", 1.0)
    top_p = body.get("top_p", 1.0)
    top_k = body.get("top_k", 0)
    if temperature is None:
        temperature = 1.0
    if top_p is None:
        top_p = 1.0
    if top_k is None or top_k == -1:  # -1 is vLLM's spelling of "off"
        top_k = 0
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not _is_real(value):
            raise bad_request(name, f"must be a number, got {value!r}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos", f"must be a bool, got {ignore_eos!r}")
    params = SamplingParams(max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
                            temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                            do_sample=float(temperature) > 0, stop_on_eos=not ignore_eos, seed=body.get("seed"),
                            truncate_prompt=False, clip_max_new_tokens=max_tokens is None)
    try:
        params.validate()
    except ValueError as exc:  # its message starts with our field name; answer with the API's
        ours = str(exc).split(" ", 1)[0]
        name = {"max_new_tokens": max_tokens_field, "stop_on_eos": "ignore_eos", "do_sample": "temperature"}.get(ours, ours)
        raise bad_request(name, str(exc).split(" ", 1)[1]) from None
    return params


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream", f"must be a bool, got {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request("stream_options", f"only {{'include_usage': bool}} is supported, got {options!r}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options", f"include_usage must be a bool, got {include!r}")
    return stream, include


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop", f"must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def check_model(model: str | None, served: str) -> None:
    """A request may name the served model or none; any other is OpenAI's 404 (type
    `invalid_request_error`, code `model_not_found`, as OpenAI answers)."""
    if model is not None and model != served:
        raise APIError(404, f"model: {model!r} is not served here; this server has {served!r}",
                       param="model", code="model_not_found")


def model_field(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"must be a string, got {model!r}")
    return model


def parse_completion(body: dict, vocab_size: int, default_max_tokens: int = 16) -> ParsedRequest:
    """POST /v1/completions. One prompt: text, [text], token ids or [token ids]."""
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt", "must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt", "batches of prompts are not supported: send one request per prompt")
    else:
        raise bad_request("prompt", f"must be a string or a list of token ids, got {prompt!r:.80}")
    stream, include_usage = _stream_fields(body)
    return ParsedRequest(model_field(body), text, ids, _sampling(body, "max_tokens", default_max_tokens),
                         _stops(body), stream, include_usage)


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The messages as plain {"role", "content": str} dicts for the tokenizer's chat template, with
    a participant's `name` where one is given (as vLLM passes it: templates that know it use it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad_request(where, f"needs a role in {list(_ROLES)}, got {m!r:.80}")
        # What OpenAI's own answers carry (`tool_calls: null`, `refusal: null`, `annotations: []`)
        # comes back when a client replays a conversation: absent in effect, so ignored.
        extra = {k for k, v in m.items() if v is not None and v != []} - {"role", "content", "name"}
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]}", "not supported (text messages only)")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"{where}.content", "only text parts are supported")
            content = "\n".join(p["text"] for p in content)  # one part a line, as vLLM joins them
        if not isinstance(content, str):
            raise bad_request(f"{where}.content", f"must be a string, got {content!r:.80}")
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}.name", f"must be a non-empty string, got {name!r:.80}")
            message["name"] = name
        out.append(message)
    return out


def chat_prompt(body: dict, tokenizer: Any, add_generation_prompt: bool = True) -> str:
    """The body's messages through the tokenizer's chat template, as text."""
    messages = chat_messages(body)
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages", "this model's tokenizer has no chat template; use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template's own checks (e.g. roles that must alternate)
        raise bad_request("messages", f"the chat template refused them: {exc}") from None


def parse_chat(body: dict, tokenizer: Any, default_max_tokens: int) -> ParsedRequest:
    """POST /v1/chat/completions: the messages through the tokenizer's chat template."""
    check_fields(body, CHAT_FIELDS)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, f"response_format: only {{'type': 'text'}} is supported, got {fmt!r}",
                       param="response_format", code="unsupported_value")
    given = [name for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]  # null: not given
    if len(given) == 2:
        raise bad_request("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    prompt = chat_prompt(body, tokenizer)
    which = given[0] if given else "max_tokens"
    stream, include_usage = _stream_fields(body)
    return ParsedRequest(model_field(body), prompt, None, _sampling(body, which, default_max_tokens),
                         _stops(body), stream, include_usage, prompt_field="messages", max_tokens_field=which)


class StopMatcher:
    """Finds stop strings in the detokenized stream, holding back only what could start one.

    Text that cannot be the beginning of a stop string is released at once, so stop strings
    cost no latency unless the stream really is in the middle of one.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._held = ""
        self.end = 0  # after a match: how many characters of the text fed last reach the match's end

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string matched); the match itself is never sent."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(i, i + len(s)) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            start, end = min(hits)
            self.end = end - len(self._held)
            self._held = ""
            return buf[:start], True
        keep = next((k for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1)
                     if any(s.startswith(buf[-k:]) for s in self.stops)), 0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


# ----------------------------------------------------------------------------- responses

_ID_BITS = random.Random()  # seeded from os.urandom once; uuid4 would read it again for every request


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_BITS.getrandbits(96):024x}"


DETOKENIZE_CONTEXT = 8  # ids before a chunk that tokens_through decodes it after (vLLM's incremental detokenizer starts with 5)


def tokens_through(tokenizer: Any, context: list[int], ids: list[int], chars: int) -> int:
    """How many of a chunk's `ids` its text needs to reach `chars` characters, detokenized as the
    worker does (IncrementalDetokenizer) after the last ids sent before it (`context`: a token's
    text can depend on the one before it, and a character can span two). A stop string found
    inside a chunk of several tokens (`--stream-interval` above 1) ends the answer at the token
    that completed it, not at the chunk's last one. A few ids, not the whole answer: this runs on
    the event loop."""
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in context:
        detok.add(token_id)
    sent = 0
    for n, token_id in enumerate(ids, 1):
        sent += len(detok.add(token_id))
        if sent >= chars:
            return n
    return len(ids)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, text: str, finish_reason: str | None, first: bool = False, stream: bool = True) -> dict:
    """One choice: `text` for completions, `delta` (stream) or `message` (whole) for chat."""
    out: dict[str, Any] = {"index": 0}
    if not chat:
        out["text"] = text
    elif stream:
        out["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    else:
        out["message"] = {"role": "assistant", "content": text}
    out["logprobs"] = None
    out["finish_reason"] = finish_reason
    return out


def envelope(chat: bool, rid: str, model: str, choices: list[dict], stream: bool, created: int | None = None,
             usage_null: bool = False) -> dict:
    """A response or chunk around its choices. `usage_null`: a stream that asked for usage
    (`stream_options.include_usage`) carries `"usage": null` in every chunk but the last, as OpenAI's do."""
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    created = int(time.time()) if created is None else created
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_null:
        body["usage"] = None
    return body


def text_event(chat: bool, rid: str, model: str, created: int | None = None,
               usage_null: bool = False) -> Callable[[str], str]:
    """A stream's text chunk as an SSE event, made from the text alone (chat: not the first chunk,
    which also carries the role).

    Why: the envelope around a token's text is the same for the whole stream, so it is rendered
    once, and a token's event is that envelope's two halves around its JSON-encoded text. Through
    json.dumps of a fresh dict every token, it was a fifth of the event loop's CPU per token. The
    bytes are those of `sse(envelope(chat, rid, model, [choice(chat, text, None)], True))`.
    """
    marker = "\x00"  # a character JSON always escapes, so its encoding occurs nowhere else in the event
    event = sse(envelope(chat, rid, model, [choice(chat, marker, None)], True, created, usage_null))
    head, tail = event.split(encode_basestring(marker))
    return lambda text: head + encode_basestring(text) + tail


def sse(data: dict | str) -> str:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"
