"""`GET /metrics` of `stagewise serve`: Prometheus' text format, counting what the requests did.

The counts are checked against what the clients were told (each response's `usage` and
`finish_reason`), the gauges against a request held in flight and against `/health`'s KV pool.
Nothing is timed: the histograms are checked for how many requests they hold, not for values.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from conftest import TEST_DEVICE
from tests.live_server import LiveServer, scrape, wait_for


@pytest.fixture(scope="module")
def loaded():
    from common.loader import load_model
    return load_model("tiny", device=TEST_DEVICE, dtype="float32")


def test_metrics_count_what_the_clients_were_told(loaded) -> None:
    server = LiveServer(loaded)
    try:
        before = scrape(server.url)
        assert before["stagewise:num_requests_running"] == before["stagewise:num_requests_waiting"] == 0
        assert before["stagewise:generation_tokens_total"] == before["stagewise:time_to_first_token_seconds_count"] == 0
        ask = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
        usages, reasons = [], []
        for prompt, n in (("Hello", 5), ("Once upon a time", 1), ("1, 2, 3,", 7)):
            got = server.client.completions.create(prompt=prompt, max_tokens=n, **ask)
            usages.append(got.usage)
            reasons.append(got.choices[0].finish_reason)
        chunks = list(server.client.completions.create(prompt="Hi", max_tokens=4, stream=True,
                                                       stream_options={"include_usage": True}, **ask))
        usages.append(chunks[-1].usage)
        reasons.append([c for c in chunks if c.choices][-1].choices[0].finish_reason)
        full = server.client.completions.create(prompt="Hello", max_tokens=24, **ask)
        usages.append(full.usage)
        reasons.append(full.choices[0].finish_reason)
        text = full.choices[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        got = server.client.completions.create(prompt="Hello", max_tokens=24, stop=[stop], **ask)
        usages.append(got.usage)
        reasons.append(got.choices[0].finish_reason)
        assert reasons == ["length"] * 5 + ["stop"]

        m = scrape(server.url)
        assert m['stagewise:request_success_total{finished_reason="length"}'] == 5
        assert m['stagewise:request_success_total{finished_reason="stop"}'] == 1
        assert m['stagewise:request_success_total{finished_reason="abort"}'] == m["stagewise:request_failure_total"] == 0
        assert m["stagewise:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
        assert m["stagewise:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
        assert m["stagewise:time_to_first_token_seconds_count"] == m["stagewise:e2e_request_latency_seconds_count"] == 6
        assert m["stagewise:time_per_output_token_seconds_count"] == sum(u.completion_tokens > 1 for u in usages)
        assert m["stagewise:num_requests_running"] == m["stagewise:num_requests_waiting"] == 0
        assert m["stagewise:kv_cache_usage_perc"] == 0  # every block back in the pool
    finally:
        server.stop()


def test_metrics_gauges_aborts_and_failures(loaded) -> None:
    server = LiveServer(loaded, slow_s=0.02)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            m = scrape(server.url)
            assert (m["stagewise:num_requests_running"], m["stagewise:num_requests_waiting"]) == (1, 0)
            kv = httpx.get(server.url + "/health", timeout=10).json()["kv_blocks"]
            assert 0 < m["stagewise:kv_cache_usage_perc"] <= 1 and kv["free"] < kv["total"]
        # the client left: its request is counted as aborted, with the tokens it was sent
        assert wait_for(lambda: scrape(server.url)['stagewise:request_success_total{finished_reason="abort"}'] == 1)
        m = scrape(server.url)
        assert m["stagewise:num_requests_running"] == 0 and m["stagewise:generation_tokens_total"] >= 1
        assert m["stagewise:e2e_request_latency_seconds_count"] == 0  # an aborted request has no latency

        with pytest.raises(openai.BadRequestError):  # refused by the engine: past the context window
            server.client.completions.create(model="tiny", prompt="Hi", max_tokens=500)
        m = scrape(server.url)
        assert m["stagewise:request_failure_total"] == 1
        assert m["stagewise:num_requests_running"] == m["stagewise:num_requests_waiting"] == 0
    finally:
        server.stop()


def test_prefix_cache_counters_are_the_engines(loaded) -> None:
    """Stage 10's block-level prefix cache: a prompt sent twice reuses its full blocks the second
    time, and /metrics says what the engine counted, in requests and in tokens."""
    from common import stages as registry
    from common.serve.app import ServeState
    from tests.live_server import ServerThread

    stage = registry.load_stage(10)
    engine = stage.InferenceEngine(loaded, max_batch_size=4)
    server = ServerThread(ServeState(stage.SchedulerManager(engine, max_batch_size=4), "tiny", "s10"))
    try:
        prompt = list(range(1000, 1040))  # two full blocks of 16 and a part
        for _ in range(2):
            server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        m, stats = scrape(server.url), engine.kv_stats()
        assert (m["stagewise:prefix_cache_hit_requests_total"], m["stagewise:prefix_cache_query_requests_total"]) == (1, 2)
        assert m["stagewise:prefix_cache_hits_total"] == stats["prefix_cache_hit_tokens"] == 32
        assert m["stagewise:prefix_cache_queries_total"] == stats["prefix_cache_query_tokens"] == 80
    finally:
        server.stop()


def test_preemption_counters_are_the_engines(loaded) -> None:
    """Stage 13: a KV pool too small for the burst makes the engine preempt; /metrics says how
    often, how many tokens it computed again, and how full the pool ran (vLLM's names)."""
    from common import stages as registry
    from common.serve.app import ServeState
    from tests.live_server import ServerThread

    stage = registry.load_stage(13)
    engine = stage.InferenceEngine(loaded, max_batch_size=4, block_size=4, num_kv_blocks=16)
    server = ServerThread(ServeState(stage.SchedulerManager(engine, max_batch_size=4), "tiny", "s13"))
    try:
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: server.client.completions.create(
                model="tiny", prompt=list(range(1000 + 7 * i, 1005 + 7 * i)), max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True}), range(4)))
        m, stats = scrape(server.url), engine.kv_stats()
        assert m["stagewise:num_preemptions_total"] == stats["num_preemptions"] > 0
        assert m["stagewise:recomputed_tokens_total"] == stats["recomputed_tokens"]
        assert m["stagewise:kv_cache_usage_peak_perc"] == stats["kv_usage_peak"] == 1.0
        assert 0 < m["stagewise:kv_cache_usage_mean_perc"] == stats["kv_usage_mean"] <= 1
    finally:
        server.stop()
