"""`stagewise serve --api-key`: every /v1/ path wants `Authorization: Bearer <key>`, as vLLM's
`--api-key` does; a missing or wrong key is OpenAI's 401 (`invalid_api_key`), which the `openai`
SDK raises as AuthenticationError. `/health` and `/metrics` stay open for probes and scrapers."""
from __future__ import annotations

import argparse
import types

import httpx
import openai
import pytest

from common.serve import engine as serve_engine
from common import stages as registry
from common.serve.app import ServeState
from conftest import TEST_DEVICE
from tests.live_server import ServerThread


@pytest.fixture(scope="module")
def server():
    from common.loader import load_model
    stage = registry.load_stage(9)
    engine = stage.InferenceEngine(load_model("tiny", device=TEST_DEVICE, dtype="float32"), max_batch_size=4,
                                   prefix_cache_max_entries=0)
    served = ServerThread(ServeState(stage.SchedulerManager(engine, max_batch_size=4), "tiny", "s09", api_key="sekret"))
    yield served
    served.stop()


def test_the_right_key_is_served(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=3).usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("key", ["wrong", "sekret2", "Sekret"])
def test_a_wrong_key_is_openais_401(server, key: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    for call in (lambda: client.models.list(),
                 lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=3),
                 lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=3, stream=True)):
        with pytest.raises(openai.AuthenticationError) as err:
            call()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_no_key_is_a_401_and_the_probes_stay_open(server) -> None:
    resp = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/nowhere", timeout=10).status_code == 401  # no path is probed without the key
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    assert server.blocks_in_use() == 0  # nothing refused reached the engine


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        serve_engine.add_serve_args(p)
        return p.parse_args(list(argv))

    monkeypatch.delenv("STAGEWISE_API_KEY", raising=False)
    assert parse().api_key is None  # open by default
    monkeypatch.setenv("STAGEWISE_API_KEY", "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "from-flag").api_key == "from-flag"
    # An empty key is none, as vLLM reads it and as our own clients send it (no header): with
    # `STAGEWISE_API_KEY=` set, every request used to be a 401, bench-serve's too.
    from common.serve.generation import ServeState
    manager = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=[0] * 8, max_model_len=16))
    assert ServeState(manager, "tiny", "s09", api_key="").bearer is None
    assert ServeState(manager, "tiny", "s09", api_key="k").bearer == b"Bearer k"
