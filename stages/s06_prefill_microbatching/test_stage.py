"""Stage 06's own idea: a burst of new requests is prefilled in ONE batched forward, duplicates once.

Cross-stage parity is in tests/test_parity.py. Here: `add_requests` of N distinct prompts runs
exactly one prefill forward (right-padded, N rows) and every request still decodes what
transformers does; identical prompts in a burst are prefilled once, with the cache on and
off; the prefix cache is consulted first; one bad request fails only itself; the worker
drains several pending requests into one `add_requests` call (never more than
`max_batch_size`); and every block comes back.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from common.requests import Request, SamplingParams
from common.tokenizer import encode
from stages.s06_prefill_microbatching import InferenceEngine, OnlineRequest, OnlineScheduler, SchedulerManager

P7 = "Tell me a story about a cat"  # 7 tokens
P12 = "one two three four five six seven eight nine ten eleven twelve"  # 12 tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ForwardSpy:
    """Stands in for engine.model (never the shared model itself): records the shape of every prefill."""

    def __init__(self, model, fail_on_first_token: int | None = None) -> None:
        self.model, self.fail_on_first_token, self.prefills = model, fail_on_first_token, []

    def __call__(self, input_ids, positions, attention, logits_indices=None):
        if type(attention).__name__ == "PrefillAttention":
            self.prefills.append(tuple(input_ids.shape))  # (rows, padded length)
            if self.fail_on_first_token in input_ids[:, 0].tolist():
                raise RuntimeError("injected prefill failure")
        return self.model(input_ids, positions, attention, logits_indices=logits_indices)


def _spy(engine: InferenceEngine, **kw) -> ForwardSpy:
    engine.model = ForwardSpy(engine.model, **kw)
    return engine.model


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _run(sched: OnlineScheduler, rids: list) -> dict[int, list[int]]:
    while sched.has_unfinished():
        sched.step()
    return {rid: sched.pop_completion(rid).token_ids for rid in rids if isinstance(rid, int)}


def _assert_pool_empty(engine: InferenceEngine) -> None:
    engine.prefix_cache.clear()
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0
    assert alloc.ref_counts == [0] * alloc.num_blocks


@pytest.mark.parametrize("entries", [64, 0])
def test_burst_of_distinct_prompts_is_one_prefill_forward(tiny, hf_greedy, entries):
    engine = InferenceEngine(tiny, max_batch_size=8, block_size=4, prefix_cache_max_entries=entries)
    spy = _spy(engine)
    sched = OnlineScheduler(engine, max_batch_size=8)
    prompts = [_ids(n, seed=n) for n in (3, 17, 1, 9, 30, 8)]
    reqs = [OnlineRequest(prompt_token_ids=p, params=SamplingParams(max_new_tokens=2 + i)) for i, p in enumerate(prompts)]
    reqs.append(OnlineRequest(prompt=P7, params=SamplingParams(max_new_tokens=6)))
    rids = sched.add_requests(reqs)
    assert all(isinstance(r, int) for r in rids) and len(set(rids)) == len(reqs)
    assert spy.prefills == [(7, 30)]  # one right-padded forward for the whole burst
    out = _run(sched, rids)
    for req, rid in zip(reqs, rids):
        ids = req.prompt_token_ids or encode(tiny.tokenizer, P7)
        assert out[rid] == hf_greedy(ids, req.params.max_new_tokens)
    _assert_pool_empty(engine)


@pytest.mark.parametrize("entries", [64, 0])
def test_in_batch_duplicates_are_prefilled_once(tiny, hf_greedy, entries):
    engine = InferenceEngine(tiny, max_batch_size=8, block_size=4, prefix_cache_max_entries=entries)
    spy = _spy(engine)
    sched = OnlineScheduler(engine, max_batch_size=8)
    sampled = SamplingParams(max_new_tokens=9, do_sample=True, temperature=1.5, seed=11, stop_on_eos=False)
    reqs = [OnlineRequest(prompt=P7, params=SamplingParams(max_new_tokens=10, stop_on_eos=False)),
            OnlineRequest(prompt=P12, params=SamplingParams(max_new_tokens=5)),
            OnlineRequest(prompt=P7, params=SamplingParams(max_new_tokens=4, stop_on_eos=False)),
            OnlineRequest(prompt=P7, params=sampled)]
    rids = sched.add_requests(reqs)
    assert spy.prefills == [(2, 12)]  # P7 and P12 once each
    first, dup = sched.session(rids[0]), sched.session(rids[2])
    assert dup.block_table == first.block_table  # shared, not copied: the duplicate ran no forward
    assert engine.pool.allocator.ref_counts[first.block_table[-1]] == 3 + (entries > 0)
    out = _run(sched, rids)
    p7 = first.prompt_ids
    assert out[rids[0]] == hf_greedy(p7, 10) and out[rids[2]] == hf_greedy(p7, 10)[:4]
    assert out[rids[1]] == hf_greedy(encode(tiny.tokenizer, P12), 5)
    alone = InferenceEngine(tiny, block_size=4, prefix_cache_max_entries=0).generate([Request(prompt=P7, params=sampled)])
    assert out[rids[3]] == alone[0].token_ids != out[rids[0]][:9]  # its own draw, on intact shared K/V
    assert len(engine.prefix_cache) == (2 if entries else 0)
    _assert_pool_empty(engine)


def test_prefix_cache_is_consulted_first(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=8, block_size=4)
    spy = _spy(engine)
    engine.generate([Request(prompt=P7, params=SamplingParams(max_new_tokens=1))])
    assert spy.prefills == [(1, 7)]
    sched = OnlineScheduler(engine, max_batch_size=8)
    rids = sched.add_requests([OnlineRequest(prompt=P7, params=SamplingParams(max_new_tokens=6)),
                               OnlineRequest(prompt=P12, params=SamplingParams(max_new_tokens=6))])
    assert spy.prefills == [(1, 7), (1, 12)]  # P7 came from the cache: only P12 went through the model
    rids += sched.add_requests([OnlineRequest(prompt=p, params=SamplingParams(max_new_tokens=6)) for p in (P12, P7)])
    assert len(spy.prefills) == 2  # all hits: no forward at all
    out = _run(sched, rids)
    assert out[rids[0]] == out[rids[3]] == hf_greedy(encode(tiny.tokenizer, P7), 6)
    assert out[rids[1]] == out[rids[2]] == hf_greedy(encode(tiny.tokenizer, P12), 6)
    assert engine.kv_stats()["prefix_cache_hits"] == 3
    _assert_pool_empty(engine)


def test_a_bad_request_fails_only_itself(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=8, block_size=4, num_kv_blocks=12)
    spy = _spy(engine)
    sched = OnlineScheduler(engine, max_batch_size=8)
    reqs = [OnlineRequest(prompt=P7, params=SamplingParams(max_new_tokens=4)),
            OnlineRequest(prompt=""),
            OnlineRequest(prompt_token_ids=_ids(9, 1), params=SamplingParams(max_new_tokens=4)),
            OnlineRequest(prompt="hi", params=SamplingParams(max_new_tokens=0)),
            OnlineRequest(prompt_token_ids=_ids(100, 2), params=SamplingParams(max_new_tokens=4)),  # > the pool
            OnlineRequest(prompt_token_ids=_ids(20, 3), params=SamplingParams(max_new_tokens=4))]  # not now
    results = sched.add_requests(reqs)
    assert [type(r).__name__ for r in results] == ["int", "ValueError", "int", "ValueError", "ValueError", "OutOfKVBlocks"]
    assert "prompt" in str(results[1]) and "max_new_tokens" in str(results[3])
    assert spy.prefills == [(2, 9)]  # the others were admitted together
    out = _run(sched, results)
    assert out[results[0]] == hf_greedy(encode(tiny.tokenizer, P7), 4)
    assert out[results[2]] == hf_greedy(reqs[2].prompt_token_ids, 4)
    _assert_pool_empty(engine)


def test_reused_request_ids_are_rejected_without_leaking(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4, prefix_cache_max_entries=0)
    sched = OnlineScheduler(engine, max_batch_size=4)
    reqs = [OnlineRequest(prompt_token_ids=_ids(5, seed), params=SamplingParams(max_new_tokens=4), request_id=5)
            for seed in (1, 2, 3)]
    results = sched.add_requests(reqs[:2]) + sched.add_requests(reqs[2:])  # in the burst, then a live one
    assert results[0] == 5 and all(isinstance(r, ValueError) and "already in use" in str(r) for r in results[1:])
    assert _run(sched, [5]) == {5: hf_greedy(reqs[0].prompt_token_ids, 4)}
    _assert_pool_empty(engine)  # the rejected ones booked nothing


def test_a_failing_batched_prefill_gives_every_block_back(tiny):
    engine = InferenceEngine(tiny, max_batch_size=8, block_size=4, num_kv_blocks=24)
    _spy(engine, fail_on_first_token=7777)
    sched = OnlineScheduler(engine, max_batch_size=8)
    two = SamplingParams(max_new_tokens=2)
    engine.generate([Request(prompt=P7, params=two)])  # a cache hit in the burst
    burst = [dict(prompt=P7), dict(prompt_token_ids=[7777, 5, 6]), dict(prompt=""), dict(prompt=P12),
             dict(prompt=P12), dict(prompt_token_ids=_ids(60, seed=1))]  # the last needs 16 blocks: it waits
    results = sched.add_requests([OnlineRequest(**r, params=two) for r in burst])
    # The four the prefill ran get its error; bad input keeps its own, and one that waits for blocks still waits.
    kinds = ["RuntimeError"] * 2 + ["ValueError"] + ["RuntimeError"] * 2 + ["OutOfKVBlocks"]
    assert [type(r).__name__ for r in results] == kinds
    assert "injected" in str(results[0]) and str(results[2]).startswith("prompt")
    assert not sched.request_ids()
    _assert_pool_empty(engine)


class _Gate:
    """Holds the manager's worker before its next admission, so a whole burst is pending at once."""

    def __init__(self, mgr: SchedulerManager) -> None:
        self.open, self.parked = threading.Event(), threading.Event()
        admit = mgr._admit_pending

        def gated() -> None:
            self.parked.set()
            self.open.wait(10)
            admit()

        mgr._admit_pending = gated
        assert self.parked.wait(10)


def test_worker_drains_pending_into_one_add_requests_call(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4, kv_cache_max_concurrency=10)
    spy = _spy(engine)
    with SchedulerManager(engine, max_batch_size=4) as mgr:
        sizes: list[int] = []
        add_requests = mgr.scheduler.add_requests
        mgr.scheduler.add_requests = lambda reqs: sizes.append(len(reqs)) or add_requests(reqs)
        gate = _Gate(mgr)
        prompts = [_ids(3 + i, seed=40 + i) for i in range(10)]
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=3) for p in prompts]
        handles.append(mgr.add_request(""))  # bad input inside a burst
        gate.open.set()
        for p, h in zip(prompts, handles):
            assert h.result(timeout=60).token_ids == hf_greedy(p, 3)
        with pytest.raises(ValueError, match="prompt"):
            handles[-1].result(timeout=60)
    assert sizes == [4, 4, 3]  # the whole backlog, max_batch_size per call
    assert [rows for rows, _ in spy.prefills] == [4, 4, 2]  # one forward per call; the bad one never ran
    _assert_pool_empty(engine)


def test_burst_members_that_finish_at_prefill_free_blocks_for_the_rest(tiny, hf_greedy):
    # Each request needs the whole pool (20-token prompt + 1 new token: 2 + 1 blocks); the first of
    # the burst ends with its prefill token, so the second must wait and run — not be failed.
    engine = InferenceEngine(tiny, max_batch_size=4, num_kv_blocks=3, prefix_cache_max_entries=0)
    with SchedulerManager(engine, max_batch_size=4) as mgr:
        gate = _Gate(mgr)
        prompts = [_ids(20, seed=60 + i) for i in range(3)]
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=1) for p in prompts]
        too_big = mgr.add_request(prompt_token_ids=_ids(40, 9), max_new_tokens=1)
        gate.open.set()
        for p, h in zip(prompts, handles):
            assert h.result(timeout=60).token_ids == hf_greedy(p, 1)
        with pytest.raises(ValueError, match="^prompt: .*KV blocks"):  # 40 + 1 tokens: 3 blocks and the spare, of 3
            too_big.result(timeout=60)
    _assert_pool_empty(engine)
