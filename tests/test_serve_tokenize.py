"""`POST /tokenize` and `/detokenize`: the server's own tokenizer, counting as the engine does.

The judge is the engine itself: `/tokenize`'s count must be the `usage.prompt_tokens` that the
same prompt (or messages) reports through `/v1/completions` (or `/v1/chat/completions`)."""
from __future__ import annotations

import httpx
import pytest

from conftest import TEST_DEVICE
from tests.live_server import LiveServer


@pytest.fixture(scope="module")
def live():
    from common.loader import load_model
    server = LiveServer(load_model("tiny", device=TEST_DEVICE, dtype="float32"))
    yield server
    server.stop()


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=10)


@pytest.mark.parametrize("prompt", ["Hello", "The capital of France is", "  two  spaces\nand a line"])
def test_tokenize_counts_what_a_completion_reports(live, prompt: str) -> None:
    got = post(live, "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True}).json()
    usage = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) == usage.prompt_tokens
    assert got["max_model_len"] == live.state.max_model_len
    assert post(live, "/detokenize", {"model": "tiny", "tokens": got["tokens"]}).json() == {"prompt": prompt}


def test_tokenize_messages_through_the_chat_template(live) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    got = post(live, "/tokenize", {"messages": messages}).json()
    usage = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    assert got["count"] == usage.prompt_tokens
    without = post(live, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < got["count"]  # the assistant's header is what the generation prompt adds
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]  # text parts: one a line, as in vLLM
    assert (post(live, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
            == post(live, "/tokenize", {"messages": [{"role": "user", "content": "Hi\nthere"}]}).json()["tokens"])


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "n": 2}, 400, "n"),
    ("/tokenize", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
])
def test_bad_input_in_openai_shape(live, path: str, body: dict, status: int, param: str) -> None:
    resp = post(live, path, body)
    assert resp.status_code == status and resp.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [('{"prompt": "Hi \\ud800"}', "prompt"),
                                         ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages")])
def test_a_lone_surrogate_is_a_400_not_a_crash(live, body: str, param: str) -> None:
    """JSON's \\ud800 escape gives Python a string no tokenizer takes: /tokenize answers the 400
    naming the field that the completion routes answer (test_serve.py)."""
    resp = httpx.post(live.url + "/tokenize", content=body.encode(), timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert "not valid Unicode" in resp.json()["error"]["message"]


def test_a_bug_on_a_fastapi_route_is_a_500_in_openai_shape(live, monkeypatch) -> None:
    """As a bug on the generation routes is (test_serve.py): OpenAI's shape, not Starlette's text."""
    import common.serve.tokenization

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(common.serve.tokenization, "tokenize", broken)
    resp = post(live, "/tokenize", {"prompt": "Hi"})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "internal_error" and "boom" in resp.json()["error"]["message"]
