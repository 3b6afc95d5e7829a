"""`stagewise serve` through the real `openai` client, on 127.0.0.1, with the tiny model.

Why the real client: "OpenAI-compatible" means whatever the SDK sends and parses works, so the
SDK (max_retries=0, so an error shows at once) is the judge, not a hand-written request. The
server runs in a thread of this process so the tests can look at its KV pool; one test starts
`stagewise serve` as a process and stops it with SIGTERM. Every wait is bounded; nothing is timed.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from common import stages as registry
from common.serve.app import ServeState
from common.serve.protocol import StopMatcher, choice, envelope, sse, text_event
from common.bench.spawn import child_env
from common.serve.transport import bind_socket
from conftest import TEST_DEVICE
from tests.live_server import LiveServer, ServerThread, in_process_texts, wait_for as _wait

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time"]


@pytest.fixture(scope="module")
def loaded():
    from common.loader import load_model
    return load_model("tiny", device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="module")
def live(loaded):
    server = LiveServer(loaded)
    yield server
    server.stop()


def _in_process(loaded, prompts: list[str], max_new_tokens: int) -> list[str]:
    return in_process_texts(loaded, [{"prompt": p} for p in prompts], max_new_tokens)


# ----------------------------------------------------------------------------- the endpoints

def test_health_and_models(live) -> None:
    health = httpx.get(live.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    assert health["kv_blocks"]["block_size"] * health["kv_blocks"]["total"] >= live.state.max_model_len
    assert [m.id for m in live.client.models.list().data] == ["tiny"]
    assert live.client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("gpt-4o")


def test_completion_greedy_equals_in_process_manager(live, loaded) -> None:
    want = _in_process(loaded, PROMPTS, 12)
    for prompt, text in zip(PROMPTS, want):
        got = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == text
        assert got.choices[0].finish_reason in ("stop", "length")
        assert got.usage.completion_tokens <= 12 and got.usage.prompt_tokens > 0
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_matches_whole_and_ends_with_usage(live) -> None:
    whole = live.client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0)
    chunks = list(live.client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for path, ask in (("/v1/completions", {"prompt": "Hello"}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {"model": "tiny", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, **ask}
        events = [json.loads(line[6:]) for line in httpx.post(live.url + path, json=body, timeout=30).text.splitlines()
                  if line.startswith("data: {")]
        assert all("usage" in e and e["usage"] is None for e in events[:-1]), path  # as OpenAI's: null, not absent
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_chat_whole_and_streamed(live, loaded) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = live.client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                temperature=0)
    prompt = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.choices[0].message.content == _in_process(loaded, [prompt], 10)[0]
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    stream = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # A null field is one not given (clients such as LangChain send them): only two given values clash.
    body = {"messages": messages, "max_tokens": None, "max_completion_tokens": 3, "temperature": 0}
    assert httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] <= 3
    clash = httpx.post(live.url + "/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=30)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "max_completion_tokens"
    # A conversation replayed from OpenAI's own answers: the assistant message's empty fields are no
    # tool content, and an empty tools list is no tools.
    replayed = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "tool_calls": None, "function_call": None,
                 "refusal": None, "audio": None, "annotations": []},
                {"role": "user", "content": "Again"}]
    resp = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                      json={"messages": replayed, "max_tokens": 2, "temperature": 0, "tools": []})
    assert resp.status_code == 200, resp.text


def test_32_concurrent_streaming_clients(live) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i % 4}" for i in range(32)]

    def one(prompt: str) -> str:
        stream = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, prompts))
    alone = {p: one(p) for p in set(prompts)}  # greedy: batching must not change a request's text
    assert texts == [alone[p] for p in prompts]
    assert _wait(lambda: live.blocks_in_use() == 0)


def test_streams_take_no_thread_per_request(loaded) -> None:
    """Open streams are read by the event loop (a listener on each request's queue), not by a
    thread each: 16 streams in flight leave the server's thread count where it was."""
    server = LiveServer(loaded, slow_s=0.05, max_batch_size=16)
    try:
        def server_threads() -> int:  # the test's own client threads are ThreadPoolExecutor-*
            return sum(not t.name.startswith("ThreadPoolExecutor") for t in threading.enumerate())

        before = server_threads()
        streams = [server.client.completions.create(model="tiny", prompt=f"Hello #{i}", max_tokens=100,
                                                    temperature=0, stream=True) for i in range(16)]
        firsts = [next(iter(s)) for s in streams]  # every stream has started: all 16 are in flight
        assert len(firsts) == 16 and server.state.manager.scheduler.has_unfinished()
        assert server_threads() <= before
        for s in streams:
            s.close()
        assert _wait(lambda: server.blocks_in_use() == 0)
    finally:
        server.stop()


def test_sampling_with_seed_repeats(live) -> None:
    ask = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
               extra_body={"top_k": 50})
    sampled = live.client.completions.create(**ask).choices[0].text
    assert live.client.completions.create(**ask).choices[0].text == sampled
    greedy = live.client.completions.create(**{**ask, "temperature": 0}).choices[0].text
    assert sampled != greedy  # it sampled: a server that ignored temperature and seed would repeat too


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_request_at_the_match(live, stream: bool) -> None:
    full = live.client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    ask = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=0, stop=[stop, "\x00never"],
               extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in live.client.completions.create(stream=True, **ask) if c.choices]
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got = live.client.completions.create(**ask)
        text, reason = got.choices[0].text, got.choices[0].finish_reason
    assert (text, reason) == (want, "stop")
    assert _wait(lambda: live.blocks_in_use() == 0)


def test_a_stop_inside_a_chunk_of_several_tokens_counts_the_tokens_up_to_it(live, loaded) -> None:
    """With --stream-interval 4 a stream's chunks carry four tokens each; a stop string completed
    by a chunk's second token ends the answer there, and `usage` counts the tokens up to it, as
    at one token a chunk (it counted the whole chunk: the count depended on the interval)."""
    from common.requests import SamplingParams
    from common.tokenizer import IncrementalDetokenizer

    stage = registry.load_stage(9)
    engine = stage.InferenceEngine(loaded, max_batch_size=4, prefix_cache_max_entries=0)
    chunked = ServerThread(ServeState(stage.SchedulerManager(engine, max_batch_size=4, stream_interval=4), "tiny", "s09"))
    try:
        ids = chunked.state.manager.add_request("Hello", params=SamplingParams(max_new_tokens=24, stop_on_eos=False)
                                                ).result(timeout=60).token_ids
        detok, texts = IncrementalDetokenizer(loaded.tokenizer), [""]  # texts[i]: the text after i tokens
        for token_id in ids:
            texts.append(texts[-1] + detok.add(token_id))
        ask = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        checked = 0
        for upto in (2, 6):  # the second token of the first chunk, and of the second
            before, text = texts[upto - 1], texts[upto]
            stop = next((text[-k:] for k in (1, 2, 3, 4) if len(text) > len(before) and text[-k:] not in before), None)
            if stop is None:
                continue  # this token adds no text a new stop string could end in
            assert live.client.completions.create(stop=[stop], **ask).usage.completion_tokens == upto  # a token a chunk
            for stream in (False, True):
                got = chunked.client.completions.create(stop=[stop], stream=stream, **ask, **(
                    {"stream_options": {"include_usage": True}} if stream else {}))
                assert (list(got)[-1] if stream else got).usage.completion_tokens == upto, (upto, stream)
                checked += 1
        assert checked
    finally:
        chunked.stop()


def test_a_prompt_long_to_tokenize_is_added_off_the_event_loop(live, monkeypatch) -> None:
    """add_request's caller tokenizes (--tokenize-workers 0): a prompt past LONG_TEXT characters
    is handed to it in a thread, so one huge prompt does not stall every stream on the event loop
    (a 4.8 MB one held /health for 6 s); a short one is added on the loop, as before. The long
    one's answer is the same: here, that it does not fit tiny's context window."""
    from common.tokenizer import LONG_TEXT

    manager, on_loop = live.state.manager, []
    real_add = manager.add_request
    monkeypatch.setattr(manager, "add_request",
                        lambda *a, **k: (on_loop.append(threading.current_thread() is live.thread), real_add(*a, **k))[1])
    assert live.client.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as err:
        live.client.completions.create(model="tiny", prompt="word " * (LONG_TEXT // 4), max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert on_loop == [True, False]
    import common.serve.tokenization as tokenization

    real_tokenize, tokenized_on_loop = tokenization.tokenize, []
    monkeypatch.setattr(tokenization, "tokenize", lambda *a: (
        tokenized_on_loop.append(threading.current_thread() is live.thread), real_tokenize(*a))[1])
    for words in (2, LONG_TEXT // 4):  # /tokenize: the same, by the body's size
        got = httpx.post(live.url + "/tokenize", json={"prompt": "word " * words}, timeout=30).json()
        assert got["count"] == len(live.state.tokenizer.encode("word " * words, add_special_tokens=False))
    assert tokenized_on_loop == [True, False]


def test_a_client_that_leaves_while_its_long_prompt_is_added_cancels_it(loaded, monkeypatch) -> None:
    """The thread that adds a long prompt finishes after its client left: the request it made is
    cancelled at once (hand_over), and nothing is left in the pool or the scheduler. (A prompt
    "long" past 10 characters here, so that it fits tiny's window and really runs.)"""
    import common.serve.generation

    monkeypatch.setattr(common.serve.generation, "LONG_TEXT", 10)
    server = LiveServer(loaded, slow_s=0.02)
    manager, cancelled, added = server.state.manager, [], threading.Event()
    real_add, real_cancel = manager.add_request, manager.cancel

    def slow_add(*args, **kwargs):
        time.sleep(1.0)  # tokenizing a long prompt; the client gives up meanwhile
        handle = real_add(*args, **kwargs)
        added.set()
        return handle

    monkeypatch.setattr(manager, "add_request", slow_add)
    monkeypatch.setattr(manager, "cancel", lambda rid: (cancelled.append(rid), real_cancel(rid))[1])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=0.3,
                       json={"model": "tiny", "prompt": "a prompt of some length", "max_tokens": 50, "ignore_eos": True})
        assert added.wait(10) and _wait(lambda: len(cancelled) == 1)
        assert _wait(lambda: server.blocks_in_use() == 0 and not manager.scheduler.request_ids())
    finally:
        server.stop()


def test_stop_matcher_holds_back_only_a_possible_start() -> None:
    m = StopMatcher(["END", "xy"])
    assert m.feed("abc") == ("abc", False)
    assert m.feed("dE") == ("d", False)  # "E" may start "END"
    assert m.feed("N") == ("", False)  # "EN" still may
    assert m.feed("Dzz") == ("", True)  # "END" matched: nothing from it onward is sent
    m = StopMatcher(["END", "xy"])
    assert m.feed("ENx") == ("EN", False)  # "ENx" cannot start "END"; "x" can start "xy"
    assert m.feed("yes") == ("", True)
    assert StopMatcher([]).feed("anything") == ("anything", False)


# ----------------------------------------------------------------------------- bad input

BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "Hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "n": 0}, 400, "n"),
    # a field named by a lone surrogate (valid JSON, not UTF-8): echoed back as its escape
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "\\ud800": 1}', 400, "\\ud800"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "\\udfff": 1}]}', 400,
     "messages[0].\\udfff"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "logprobs": 0}, 400, "logprobs"),  # the sampled tokens'
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "n": []}, 400, "n"),  # [] is off only for a list field
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "presence_penalty": {}}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "echo": []}, 400, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2.5]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_k": 2.5}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "mystery": 1}, 400, "mystery"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi \\ud800"}', 400, "prompt"),  # a lone surrogate: not text
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),  # deeper than Python's stack
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x", "name": 7}]}, 400,
     "messages[0].name"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
     400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 0},
     400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "content": "x",
                                                             "tool_calls": [{"id": "1"}]}]}, 400, "messages[0].tool_calls"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -3}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{b[2]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_answered_in_openai_shape(live, path, body, status, param) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"  # OpenAI's, for every 4xx here
    if param:
        assert error["message"].startswith(param)
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200  # still serving


def test_wrong_method_and_unknown_path_in_openai_shape(live) -> None:
    """The generation routes answer their own 405; every other path is still FastAPI's 404."""
    for method, path, status, allow in [("GET", "/v1/completions", 405, "POST"), ("GET", "/v1/chat/completions", 405, "POST"),
                                        ("POST", "/v1/models", 405, "GET"),
                                        ("POST", "/v1/embeddings", 404, None), ("GET", "/nothing", 404, None)]:
        resp = httpx.request(method, live.url + path, timeout=10)
        assert resp.status_code == status, (method, path)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert resp.json()["error"]["type"] == "invalid_request_error", (method, path)
        assert resp.headers.get("allow") == allow, (method, path)  # a 405 says which method would do


def test_an_unexpected_error_is_a_500_in_openai_shape(live, monkeypatch) -> None:
    """A bug while handling one request answers 500 with the error object; serving goes on."""
    import common.serve.app

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(common.serve.app, "parse_completion", broken)
    resp = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "internal_error" and "boom" in resp.json()["error"]["message"]
    monkeypatch.undo()
    assert live.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices


def test_a_client_gone_before_its_body_arrived_is_no_error(live, caplog) -> None:
    """Headers promising 100 bytes, 10 sent, then the connection closed: nothing to answer and no
    error logged (it is not the server's bug); the next request is served as usual."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
    for path in ("/tokenize", "/detokenize"):  # the routes that read the body through Starlette
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as conn:
            conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                         + b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    assert live.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_openai_client_raises_on_refusals(live) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        live.client.completions.create(model="tiny", prompt="Hi", n=3)
    assert err.value.status_code == 400 and err.value.param == "n" and "only n = 1" in err.value.message
    with pytest.raises(openai.NotFoundError):
        live.client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert live.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices  # and it goes on


def test_a_prompt_the_kv_pool_can_never_hold_is_a_400_naming_the_field(loaded) -> None:
    """Stages 03-12 book prompt + max_new_tokens: the 400 names the prompt when it cannot fit even
    alone, else the request's max-tokens field (what the client can lower)."""
    server = LiveServer(loaded, num_kv_blocks=2, block_size=16)  # 32 tokens in all
    try:
        with pytest.raises(openai.BadRequestError, match="KV blocks") as err:
            server.client.completions.create(model="tiny", prompt=list(range(1000, 1080)), max_tokens=4)
        assert err.value.param == "prompt"
        with pytest.raises(openai.BadRequestError, match="KV blocks") as err:  # a stream too: no 200 before a token
            server.client.completions.create(model="tiny", prompt=list(range(1000, 1080)), max_tokens=4, stream=True)
        assert err.value.param == "prompt"
        with pytest.raises(openai.BadRequestError, match="KV blocks") as err:  # 5 + 40 tokens: lower max_tokens
            server.client.completions.create(model="tiny", prompt=list(range(1000, 1005)), max_tokens=40)
        assert err.value.param == "max_tokens" and "400 - max_tokens: a request needs" in err.value.message
        assert server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices  # it goes on
    finally:
        server.stop()


def test_a_request_that_outgrows_the_kv_pool_is_a_400_naming_max_tokens(loaded) -> None:
    """From stage 13 on a request books only its prompt's blocks, so one can grow past the whole pool
    while it runs: it ends with a 400 whose `param` is the request's own max-tokens field (what the
    client can lower), and the server goes on."""
    stage = registry.load_stage(13)
    engine = stage.InferenceEngine(loaded, max_batch_size=2, block_size=4, num_kv_blocks=12)  # 48 tokens in all
    server = ServerThread(ServeState(stage.SchedulerManager(engine, max_batch_size=2), "tiny", "s13"))
    try:
        grows = dict(max_tokens=60, extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as err:
            server.client.completions.create(model="tiny", prompt=[1000, 1001, 1002], **grows)
        assert (err.value.param, err.value.code) == ("max_tokens", "invalid_value")
        message = err.value.body["message"]
        assert message.startswith("max_tokens: request") and "past the whole KV pool" in message
        assert "max_new_tokens" not in message  # only the request's own name for the field
        with pytest.raises(openai.BadRequestError) as err:
            server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                  max_completion_tokens=60, extra_body={"ignore_eos": True})
        assert err.value.param == "max_completion_tokens"
        assert server.client.completions.create(model="tiny", prompt=[1000], max_tokens=2).choices  # it goes on
        assert _wait(lambda: server.blocks_in_use() == 0)
    finally:
        server.stop()


# ----------------------------------------------------------------------------- dropping and stopping

def test_client_dropping_mid_stream_frees_its_blocks(loaded) -> None:
    server = LiveServer(loaded, slow_s=0.02)
    manager, cancelled = server.state.manager, []
    real_cancel = manager.cancel
    manager.cancel = lambda rid: (cancelled.append(rid), real_cancel(rid))[1]  # the drop must cancel, not run on
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]  # three events (each followed by a blank line)
            assert sum(line.startswith("data: {") for line in got) == 3
            assert server.blocks_in_use() > 0
        assert _wait(lambda: len(cancelled) == 1)
        assert _wait(lambda: server.blocks_in_use() == 0 and not server.state.manager.scheduler.request_ids())
        with pytest.raises(httpx.ReadTimeout):  # a whole (non-streamed) request, abandoned while it runs
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        assert _wait(lambda: len(cancelled) == 2)
        assert _wait(lambda: server.blocks_in_use() == 0 and not server.state.manager.scheduler.request_ids())
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_its_first_token_cancels_its_request_then(loaded, stream: bool) -> None:
    """Behind a running request that holds the KV pool (sized for one context window), a client
    that gives up while its request waits has it cancelled at once, as vLLM's with_cancellation
    does: it was prefilled and decoded until its first token could not be sent (a whole request:
    until a poll half a second later)."""
    server = LiveServer(loaded, slow_s=0.02, max_batch_size=1)
    manager, cancelled = server.state.manager, []
    real_cancel = manager.cancel
    # each cancel, with the requests still in the scheduler beside it
    manager.cancel = lambda rid: (cancelled.append(set(manager.scheduler.request_ids()) - {rid}), real_cancel(rid))[1]
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}  # 2 s or more of steps
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: {")  # it runs, and holds the batch
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=0.5)
            assert _wait(lambda: len(cancelled) == 1)
            assert cancelled[0], "cancelled only once the running request had ended"
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the running one went on to its end
        assert _wait(lambda: server.blocks_in_use() == 0 and not manager.scheduler.request_ids())
    finally:
        server.stop()


def test_shutdown_ends_every_in_flight_request_and_releases_the_port(loaded) -> None:
    server = LiveServer(loaded, slow_s=0.02)
    started, outcomes = threading.Barrier(5), []

    def client() -> None:
        stream = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=100, stream=True,
                                                  extra_body={"ignore_eos": True})
        try:
            for i, _ in enumerate(stream):
                if i == 0:
                    started.wait(30)
            outcomes.append("finished")
        except openai.APIError as exc:  # the stream's error event: "the server is shutting down"
            outcomes.append(exc.message)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(30)
    server.state.begin_shutdown()  # what SIGTERM does first: refuse new requests...
    refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    server.stop()  # ...then uvicorn stops
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 4 and all("shutting down" in o for o in outcomes)
    assert server.blocks_in_use() == 0
    bind_socket("127.0.0.1", server.port).close()  # the port is free again


@pytest.mark.parametrize("where", [[], ["--engine-process"]], ids=["engine-inside", "engine-process"])
def test_sigterm_stops_the_serve_process(tmp_path: Path, where: list[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "common.cli", "serve", "--model", "tiny", "--device", "cpu",
                             "--port", "0", *where], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", proc.stdout.readline()).group(0)
        assert _wait(lambda: _healthy(url), timeout=60)
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 120, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            tail = list(lines)  # the stream ends (finished or cancelled), it does not hang
        assert tail[-2:] == ["data: [DONE]", ""] or tail[-1:] == ["data: [DONE]"]
        assert proc.wait(30) == 0
        bind_socket("127.0.0.1", int(url.rsplit(":", 1)[1])).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_kv_pool_smaller_than_the_context_window_is_noted_at_start_up() -> None:
    """vLLM refuses to start then; serve says what it means (a chat without max_tokens asks for
    the whole window) and how to make room, from /health's kv_blocks."""
    from common.serve.server import pool_note

    note = pool_note({"free": 4, "total": 4, "block_size": 16}, 128)
    assert note.startswith("stagewise serve: note: the KV pool holds 64 tokens, fewer than the context window (128)")
    assert "--num-kv-blocks" in note
    assert pool_note({"free": 3, "total": 8, "block_size": 16}, 128) is None and pool_note(None, 128) is None


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- bench-serve

@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_bench_serve_reports_over_http(live, tmp_path: Path, capsys, loop: str) -> None:
    from common.serve import bench as bench_serve
    out = tmp_path / "serve.json"
    bench_serve.main(["--base-url", live.url, "--model", "tiny", "--num-requests", "6", "--max-new-tokens", "5",
                      "--no-stop-on-eos", "--warmup-runs", "0", "--repeat-runs", "2", "--max-concurrency", "3",
                      "--loop", loop, "--json", str(out)])
    report = capsys.readouterr().out
    assert "=== streaming benchmark (HTTP) ===" in report and "TTFT p50/p95/p99" in report
    data = json.loads(out.read_text())
    assert data["requests"] == 6 and data["completion_tokens"] == 30 and len(data["runs"]) == 2
    assert data["throughput_tok_s"]["completion"] > 0 and data["server"]["data"][0]["id"] == "tiny"
    assert "git_commit" in data["env"] and "cpu_model" in data["env"]
    assert data["config"]["loop"] == loop


def test_bench_serve_reports_the_servers_error(live) -> None:
    """A refused request fails the run with the server's status and message, not a parse error."""
    from common.serve import bench as bench_serve
    with pytest.raises(RuntimeError, match=r"HTTP 404.*model_not_found"):
        bench_serve.main(["--base-url", live.url, "--model", "not-this-one", "--num-requests", "2",
                          "--max-new-tokens", "2", "--warmup-runs", "0", "--repeat-runs", "1"])


def test_serve_refuses_a_stage_without_a_scheduler_manager() -> None:
    import argparse

    from common.serve import engine as serve_engine
    p = argparse.ArgumentParser()
    serve_engine.add_serve_args(p)
    with pytest.raises(SystemExit, match="stage 4 or later"):
        serve_engine.build_manager(p.parse_args(["--stage", "3", "--model", "tiny"]))


def test_serve_names_the_engine_knobs_its_stage_does_not_take(monkeypatch, capsys) -> None:
    """As the bench notes them: a server would run without them all its life without a word.
    A note, not a refusal: serve-overhead and serve-compare pass flags that suit every stage."""
    import argparse

    import common.loader
    from common.serve import engine as serve_engine

    class Loaded(Exception):
        pass

    def no_load(*args, **kwargs):
        raise Loaded
    monkeypatch.setattr(common.loader, "load_model", no_load)
    p = argparse.ArgumentParser()
    serve_engine.add_serve_args(p)
    for flags, note in ((["--stage", "9", "--max-num-batched-tokens", "512"],
                         "s09_batched_worker_lookups takes no max_num_batched_tokens: not applied"),
                        (["--stage", "4", "--no-prefix-cache", "--prefill-max-batch-size", "64"],
                         "s04_online_scheduler takes no prefill_max_batch_size, prefix_cache_max_entries: not applied"),
                        (["--stage", "13", "--max-num-batched-tokens", "512"], None)):
        with pytest.raises(Loaded):  # the note comes before the model loads
            serve_engine.build_manager(p.parse_args([*flags, "--model", "tiny"]))
        err = capsys.readouterr().err
        assert (f"stagewise serve: note: {note}\n" == err) if note else err == ""
    with pytest.raises(ValueError, match="^--prefix-cache-max-entries: cannot go with --no-prefix-cache"):
        serve_engine.build_manager(p.parse_args(["--stage", "9", "--no-prefix-cache", "--prefix-cache-max-entries", "8",
                                                 "--model", "tiny"]))


def test_a_message_name_reaches_the_chat_template() -> None:
    """A participant's `name` goes to the template beside role and content, as vLLM passes it."""
    from common.serve.protocol import chat_prompt

    class Template:
        chat_template = "records what it is given"

        def apply_chat_template(self, messages, **kwargs) -> str:
            self.seen = messages
            return "prompt"

    tokenizer = Template()
    chat_prompt({"messages": [{"role": "developer", "content": "Be brief.", "name": None},
                              {"role": "user", "content": "Hi", "name": "ana"}]}, tokenizer)
    assert tokenizer.seen == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ana"}]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage_null", [False, True])
def test_text_event_is_the_dict_path_byte_for_byte(chat: bool, usage_null: bool) -> None:
    """A token's SSE event from the per-stream template equals json.dumps of the whole chunk."""
    make = text_event(chat, "cmpl-1", "tiny", 123, usage_null)
    for text in ["Hello", ' "quoted" \\ back', "line\nbreak\ttab", "é 中文 🙂", "\x00\x1f", "</script>", "data: x\n\n"]:
        assert make(text) == sse(envelope(chat, "cmpl-1", "tiny", [choice(chat, text, None)], True, 123, usage_null))


def test_event_stream_closes_its_events_when_the_client_leaves_during_a_send() -> None:
    """A send that waits (a full socket buffer) when the client goes: EventStream, inside the
    request's CancelOnDisconnect, ends, and its events generator is closed before it returns, so
    the request is cancelled at once, not whenever the generator happens to be collected."""
    from common.serve.transport import CancelOnDisconnect, EventStream

    closed: list[bool] = []

    async def events():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            closed.append(True)  # generate()'s finally (handle.cancel()) runs from here

    async def main() -> bool:
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message.get("body"):
                gone.set()  # the client leaves while this write waits
                await asyncio.Event().wait()

        async with CancelOnDisconnect(receive):
            await EventStream(events())({"type": "http"}, receive, send)
        return bool(closed)

    assert asyncio.run(main())


def test_a_malformed_token_id_prompt_is_not_called_a_batch() -> None:
    from common.serve.protocol import APIError, parse_completion

    for prompt, says in (([1, 2.5], "must be a string or a list of token ids"), ([1, "a"], "must be a string"),
                         (["a", "b"], "batches of prompts are not supported"), ([[1], [2]], "batches")):
        with pytest.raises(APIError, match=f"^prompt: {says}"):
            parse_completion({"model": "tiny", "prompt": prompt}, 100, 16)
