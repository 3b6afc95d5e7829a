"""The engine in its own process (common/serve/engine_process.py), `stagewise serve`'s default.

It must behave as the SchedulerManager it stands for: the same greedy text and streams, errors on
the request that caused them, cancel and close ending requests and freeing their KV blocks; and
when the engine process dies, every open request ends with an error and the server says so
instead of hanging. Each test starts one engine process with the tiny model (a fresh Python:
seconds), so there are few tests and each checks several things. Every wait is bounded; nothing
is timed.
"""
from __future__ import annotations

import argparse
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from common.serve import engine as serve_engine
from common.requests import ContextLengthExceeded
from common.serve.engine_process import EngineProcess, kv_blocks
from common.tokenizer import LONG_TEXT, encode
from common.serve.app import ServeState
from conftest import TEST_DEVICE
from tests.live_server import ServerThread, in_process_texts, scrape, slow_down, wait_for as _wait

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time"]


def serve_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_engine.add_serve_args(p)
    return p.parse_args(["--stage", "9", "--model", "tiny", "--device", TEST_DEVICE, "--dtype", "float32",
                         "--no-prefix-cache", *flags])


def in_process(requests: list[dict], max_new_tokens: int) -> list[str]:
    from common.loader import load_model
    return in_process_texts(load_model("tiny", device=TEST_DEVICE, dtype="float32"), requests, max_new_tokens)


def test_streams_results_and_errors_are_the_managers() -> None:
    prompts = [{"prompt": p} for p in PROMPTS] + [{"prompt_token_ids": [1, 2, 3]}]
    expected = in_process(prompts, 8)
    with EngineProcess(serve_args()) as engine:
        assert engine.engine.stage == "s09_batched_worker_lookups" and engine.engine.max_model_len > 0
        assert engine.engine.dtype == "float32" and len(engine.engine.tokenizer) > 0  # what the server reads
        handles = [engine.add_request(**p, max_new_tokens=8) for p in prompts]
        streamed = ["".join(chunk.text for chunk in h) for h in handles]
        results = [h.result(timeout=60) for h in handles]
        assert streamed == [r.text for r in results] == expected
        assert all(r.finish_reason in ("stop", "length") and r.timings["first_token"] > 0 for r in results)
        # Bad input fails its own request, with the manager's error, and the engine goes on.
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.add_request("Hi", max_new_tokens=0).result(timeout=30)
        with pytest.raises(ValueError, match="^no_such_knob: not a sampling field"):
            engine.add_request("Hi", no_such_knob=1).result(timeout=30)
        with pytest.raises(RuntimeError, match="AttributeError"):  # a call's error comes back as well
            engine.call(getattr, "no_such_attribute").result(timeout=30)
        # A long text is tokenized on this side, so the engine's main thread never encodes megabytes
        # while other requests wait behind it; the engine sees its ids (and keeps the last that fit, as it
        # does a text's), or refuses them as it would the text.
        sent: list[tuple] = []
        send = engine._send
        engine._send = lambda message: (sent.append(message), send(message))[1]
        long_text = "Hello " * (LONG_TEXT // 6 + 1)
        ids = encode(engine.engine.tokenizer, long_text)
        window = engine.engine.max_model_len
        assert engine.add_request(long_text, max_new_tokens=2).result(timeout=60).prompt_token_ids == ids[-window:]
        with pytest.raises(ContextLengthExceeded, match="^prompt"):
            engine.add_request(long_text, max_new_tokens=2, truncate_prompt=False).result(timeout=60)
        assert [m[2:4] for m in sent] == [(long_text, ids)] * 2
        assert engine.add_request("Hi", max_new_tokens=2).result(timeout=30).token_ids
        assert sent[2][2:4] == ("Hi", None)  # a short text goes as it is: the engine tokenizes it, as in-process
        pool = engine.call(kv_blocks).result(timeout=30)
        assert pool["free"] == pool["total"] > 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("Hi")
    with pytest.raises(ProcessLookupError):  # it exited and was reaped
        os.kill(engine.pid, 0)


def test_cancel_and_close_end_every_request_and_free_its_blocks() -> None:
    with EngineProcess(serve_args("--max-batch-size", "4")) as engine:
        engine.call(slow_down, 0.02).result(timeout=30)
        handle = engine.add_request("Hello", max_new_tokens=200, stop_on_eos=False)
        next(iter(handle))  # running: it holds blocks
        pool = engine.call(kv_blocks).result(timeout=30)
        assert pool["free"] < pool["total"]
        handle.cancel()
        assert handle.result(timeout=30).finish_reason == "cancelled"
        assert _wait(lambda: (lambda kv: kv["free"] == kv["total"])(engine.call(kv_blocks).result(timeout=30)))
        in_flight = [engine.add_request("Hi", max_new_tokens=200, stop_on_eos=False) for _ in range(3)]
        for h in in_flight:
            next(iter(h))
        engine.close()  # while they run
        assert [h.result(timeout=30).finish_reason for h in in_flight] == ["cancelled"] * 3


def test_a_stage_without_a_manager_fails_to_start_with_its_reason() -> None:
    with pytest.raises(SystemExit, match="stage 4 or later"):
        EngineProcess(serve_args("--stage", "3"))


class Served(ServerThread):
    """`stagewise serve --engine-process` as its main() builds it (engine process, then server), in a thread."""

    def __init__(self, *flags: str) -> None:
        self.engine = EngineProcess(serve_args(*flags))
        super().__init__(ServeState(self.engine, "tiny", self.engine.engine.stage))

    def stop(self) -> None:
        super().stop()
        assert self.state.wait_closed(30)


def test_serve_over_an_engine_process() -> None:
    """The server as `stagewise serve` runs it: concurrent streams with the in-process text, a
    dropped client's blocks freed, and a shutdown that ends the requests still running."""
    served = Served("--max-batch-size", "8")
    try:
        expected = in_process([{"prompt": p} for p in PROMPTS], 8)

        def stream(prompt: str) -> str:
            chunks = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(stream, PROMPTS * 4))
        assert got == expected * 4
        assert httpx.get(served.url + "/health", timeout=10).json()["kv_blocks"]["free"] > 0
        metrics = scrape(served.url)  # the KV pool asked of the engine's process, the rest counted here
        assert metrics["stagewise:kv_cache_usage_perc"] == 0
        assert sum(metrics[f'stagewise:request_success_total{{finished_reason="{r}"}}'] for r in ("stop", "length")) == 16
        with pytest.raises(openai.BadRequestError) as err:  # refused in the engine's process, named here
            served.client.completions.create(model="tiny", prompt="Hi", max_tokens=500)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_tokens")

        served.engine.call(slow_down, 0.02).result(timeout=30)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            assert served.blocks_in_use() > 0
        assert _wait(lambda: served.blocks_in_use() == 0)  # the drop cancelled it in the engine's process

        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(lines)
            served.stop()  # SIGTERM's path, with a request in flight
            tail = list(lines)
        assert tail[-2:] == ["data: [DONE]", ""] or tail[-1:] == ["data: [DONE]"]
        assert any("shutting down" in line for line in tail)  # it ended, cancelled, and said why
        with pytest.raises(ProcessLookupError):
            os.kill(served.engine.pid, 0)
    finally:
        if served.thread.is_alive():
            served.stop()


def test_a_dead_engine_ends_its_requests_and_the_server_answers_503() -> None:
    served = Served()
    try:
        served.engine.call(slow_down, 0.02).result(timeout=30)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(lines)
            os.kill(served.engine.pid, signal.SIGKILL)
            tail = list(lines)  # the stream ends with an error event, it does not hang
        assert any("engine process has ended" in line for line in tail) and tail[-2:] == ["data: [DONE]", ""]
        health = httpx.get(served.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine process has ended" in health.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as err:
            served.client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        served.stop()


def tp_ranks(manager) -> list[int]:
    """The pids of a tensor-parallel engine's other ranks (asked of the engine's process)."""
    return [p.pid for p in manager.engine.tp.workers]


def test_serve_with_the_model_split_across_two_ranks() -> None:
    """`stagewise serve --stage 14 --tensor-parallel-size 2`: the server, the engine's process
    (rank 0, the scheduler) and one more rank it starts; streams give the one-process text, and
    the server's shutdown ends the other rank too."""
    import torch

    device = TEST_DEVICE if TEST_DEVICE == "cpu" or torch.cuda.device_count() >= 2 else "cpu"  # a GPU per rank, or gloo
    served = Served("--stage", "14", "--tensor-parallel-size", "2", "--device", device)
    try:
        expected = in_process([{"prompt": p} for p in PROMPTS], 8)
        ranks = served.engine.call(tp_ranks).result(timeout=30)
        assert len(ranks) == 1

        def stream(prompt: str) -> str:
            chunks = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(stream, PROMPTS)) == expected
        served.stop()
        for pid in [served.engine.pid, *ranks]:
            assert _wait(lambda: not _alive(pid), timeout=30), pid
    finally:
        if served.thread.is_alive():
            served.stop()


def test_a_dead_rank_makes_the_server_unhealthy_and_fails_requests_with_its_reason() -> None:
    """Rank 1 killed between requests: rank 0's process lives on, but no step can run, so /health
    answers 503 with the reason at once (before any request finds out), and a request ends with it."""
    served = Served("--stage", "14", "--tensor-parallel-size", "2", "--device", "cpu")
    try:
        assert served.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        (rank,) = served.engine.call(tp_ranks).result(timeout=30)
        os.kill(rank, signal.SIGKILL)
        assert _wait(lambda: not _alive(rank), timeout=30)
        health = httpx.get(served.url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1 died" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="rank 1 died"):
            served.client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert httpx.get(served.url + "/health", timeout=10).status_code == 503  # for good
    finally:
        served.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) has ended too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
    return True
