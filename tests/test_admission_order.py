"""First come, first served: a request that waits for KV blocks is not overtaken (every streaming stage).

Why: admission used to skip a request the pool could not hold yet and admit the smaller ones
behind it. Under a steady stream of small requests a large one then waited for good: a hang for
its client, though every block was accounted for. vLLM's waiting queue, nano-vllm's and SGLang's
all stop at the first request that does not fit; so do ours now. Stages 06+ admit a burst in
`OnlineScheduler.add_requests`, checked here directly; stages 04-05 admit one request at a time
from their SchedulerManager's worker, checked through it. Nothing here is timed.
"""
from __future__ import annotations

import importlib
import threading

import pytest

from common import stages as registry
from common.requests import SamplingParams
from conftest import burst_packages, streaming_packages

STREAMING = streaming_packages()
BURSTS = burst_packages()
ONE_AT_A_TIME = [p for p in STREAMING if p not in BURSTS]


def _ids(n: int, first: int) -> list[int]:
    return [first + i for i in range(n)]


def _params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, stop_on_eos=False)


@pytest.mark.parametrize("package", BURSTS, ids=registry.short_name)
def test_a_burst_stops_at_the_first_request_the_pool_cannot_hold(package, tiny) -> None:
    """10 blocks of 16: A's 100-token prompt holds 7 (stages 06-12 book its 20 new tokens too: 8).
    B needs 3 more, which do not fit beside A; C needs 1, which would. C waits behind B, and both
    come in once A is done."""
    stage = registry.load_stage(package)
    request = importlib.import_module(f"{package}.scheduler").OnlineRequest
    out_of_blocks = importlib.import_module(f"{package}.kv_cache").OutOfKVBlocks
    sched = stage.OnlineScheduler(stage.InferenceEngine(tiny, max_batch_size=8, num_kv_blocks=10), max_batch_size=8)
    a = request(prompt_token_ids=_ids(100, 1000), params=_params(20))
    b = request(prompt_token_ids=_ids(40, 2000), params=_params(4))
    c = request(prompt_token_ids=_ids(4, 3000), params=_params(4))
    [a_id] = sched.add_requests([a])
    assert isinstance(a_id, int)
    waiting = sched.add_requests([b, c])
    assert all(isinstance(r, out_of_blocks) for r in waiting), waiting  # C is not let past B
    assert "an earlier request of the burst waits" in str(waiting[1])
    completions = {}
    while sched.has_unfinished():
        sched.step()
        for rid in sched.pop_finished_ids():
            completions[rid] = sched.pop_completion(rid)
    assert len(completions[a_id].token_ids) == 20
    b_id, c_id = sched.add_requests([b, c])  # the pool is free again: both, in order
    assert isinstance(b_id, int) and isinstance(c_id, int) and b_id < c_id


@pytest.mark.parametrize("package", ONE_AT_A_TIME, ids=registry.short_name)
def test_the_worker_admits_no_request_past_one_that_waits(package, tiny, monkeypatch) -> None:
    """Stages 04-05 admit one request at a time: while B waits for blocks (held back here until
    C has been submitted and the worker has gone round again), the worker must not try C."""
    stage = registry.load_stage(package)
    out_of_blocks = importlib.import_module(f"{package}.kv_cache").OutOfKVBlocks
    manager = stage.SchedulerManager(stage.InferenceEngine(tiny, max_batch_size=4), max_batch_size=4)
    tried: list[int] = []
    c_queued, refused_since, release = threading.Event(), [], threading.Event()
    refused_twice_since_c = threading.Event()
    real = manager.scheduler.add_request
    b_first = 2000

    def add_request(*args, prompt_token_ids=None, **kwargs):
        tried.append(prompt_token_ids[0])
        if prompt_token_ids[0] == b_first and not release.is_set():
            if c_queued.is_set():
                refused_since.append(True)
                if len(refused_since) >= 2:  # the second round after C was queued drained C with B
                    refused_twice_since_c.set()
            raise out_of_blocks("held back by the test")
        return real(*args, prompt_token_ids=prompt_token_ids, **kwargs)

    monkeypatch.setattr(manager.scheduler, "add_request", add_request)
    with manager:
        a = manager.add_request(prompt_token_ids=_ids(4, 1000), params=_params(100))  # keeps the worker stepping
        b = manager.add_request(prompt_token_ids=_ids(4, b_first), params=_params(2))
        c = manager.add_request(prompt_token_ids=_ids(4, 3000), params=_params(2))
        c_queued.set()
        assert refused_twice_since_c.wait(30)  # B refused again, in rounds that had C behind it
        assert 3000 not in tried  # C never tried while B waits
        release.set()
        results = [h.result(timeout=60) for h in (a, b, c)]
    assert [len(r.token_ids) for r in results] == [100, 2, 2]
    assert tried.index(3000) > tried.index(b_first) and tried[-2:] == [b_first, 3000]  # B admitted, then C
