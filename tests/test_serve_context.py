"""What does not fit the model's context window, over HTTP: refused as OpenAI's API refuses it.

A prompt longer than the window (or one that leaves no room for a token), and a `max_tokens` the
client gave that reaches past it, get a 400 with `context_length_exceeded` and the request's own
field name, never a silently cut prompt; a default `max_tokens` ends where the window does. The
check is common's (`prepare_prompt`), so every stage `stagewise serve` can run makes it. Through
the real `openai` client on 127.0.0.1, with the tiny model (a 128-token window); nothing is timed.
"""
from __future__ import annotations

import openai
import pytest

from common import stages as registry
from common.requests import ContextLengthExceeded, SamplingParams
from conftest import streaming_packages
from tests.live_server import LiveServer, wait_for as _wait


@pytest.fixture(scope="module")
def live(tiny):
    server = LiveServer(tiny)
    yield server
    server.stop()


def test_what_does_not_fit_the_context_window_is_a_400(live) -> None:
    """As OpenAI's API (and vLLM, SGLang) answer: a prompt longer than the window, or a max_tokens
    the client gave that reaches past it, is refused with `context_length_exceeded` naming the
    request's own field, never truncated; a default max_tokens ends where the window does.
    tiny's window is 128 tokens."""
    window = live.state.max_model_len
    chat = live.client.chat.completions
    too_long = [("completions", dict(prompt=list(range(1000, 1000 + window)), max_tokens=4), "prompt"),
                ("completions", dict(prompt=list(range(1000, 1100)), max_tokens=window - 99), "max_tokens"),
                ("chat", dict(messages=[{"role": "user", "content": "word " * window}]), "messages"),
                ("chat", dict(messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=window),
                 "max_completion_tokens")]
    for api, kwargs, param in too_long:
        for stream in (False, True):  # a stream too: refused before its 200
            create = live.client.completions.create if api == "completions" else chat.create
            with pytest.raises(openai.BadRequestError) as err:
                create(model="tiny", stream=stream, **kwargs)
            assert (err.value.code, err.value.param) == ("context_length_exceeded", param)
            message = err.value.body["message"]
            assert message.startswith(param + " ") and f"context window is {window} tokens" in message
    fits = live.client.completions.create(model="tiny", prompt=list(range(1000, 1100)), max_tokens=window - 100,
                                          extra_body={"ignore_eos": True})
    assert (fits.usage.prompt_tokens, fits.usage.completion_tokens) == (100, window - 100)
    # no max_tokens: OpenAI's default of 16 for a completion, cut to the 8 the window has left
    clipped = live.client.completions.create(model="tiny", prompt=list(range(1000, 1120)),
                                             extra_body={"ignore_eos": True})
    assert clipped.usage.completion_tokens == 8 and clipped.choices[0].finish_reason == "length"
    assert _wait(lambda: live.blocks_in_use() == 0)


@pytest.mark.parametrize("package", streaming_packages())
def test_every_streaming_stage_refuses_what_does_not_fit_when_asked(package: str, tiny) -> None:
    """The check is common's (prepare_prompt), so every stage `serve` can run makes it: its
    manager ends such a request with ContextLengthExceeded and serves the next one."""
    stage = registry.load_stage(package)
    strict = dict(truncate_prompt=False, clip_max_new_tokens=False)
    with stage.SchedulerManager(stage.InferenceEngine(tiny, max_batch_size=2), max_batch_size=2) as manager:
        window = manager.engine.max_model_len
        for ids, max_new, field in [(list(range(1000, 1000 + window)), 1, "prompt"),
                                    (list(range(1000, 1010)), window - 9, "max_new_tokens")]:
            handle = manager.add_request(prompt_token_ids=ids, params=SamplingParams(max_new_tokens=max_new, **strict))
            with pytest.raises(ContextLengthExceeded) as err:
                handle.result(timeout=60)
            assert err.value.field == field
        fits = manager.add_request(prompt_token_ids=list(range(1000, 1010)),
                                   params=SamplingParams(max_new_tokens=window - 10, stop_on_eos=False, **strict))
        assert len(fits.result(timeout=60).token_ids) == window - 10
