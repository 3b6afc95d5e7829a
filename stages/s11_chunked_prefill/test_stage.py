"""Stage 11's own idea: a step is one forward under a token budget, decode rows first, then prompt chunks.

Cross-stage parity is in tests/test_parity.py. Here: greedy tokens equal transformers' and an
unchunked run when every prompt is longer than the budget; streams keep decoding every step
while a long prompt is prefilled, and each step is one forward of exactly the budget; a chunk
starts at the first uncached block; a cancel in the middle of a chunked prefill frees every
block; a randomized submit/cancel run leaves no block in use; a budget below the decode batch
is refused.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from common.requests import Request, SamplingParams
from stages import s11_chunked_prefill as s11

BS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _all_free(engine) -> None:
    alloc = engine.pool.allocator
    assert alloc.reserved == 0
    assert alloc.num_free == alloc.num_blocks and not any(alloc.ref_counts)
    assert set(engine.prefix_cache._key_of) == alloc.cached


def _record_steps(engine) -> list[dict]:
    """Spy on every step's forward: its decode rows, its chunks (first position, tokens computed),
    the model calls it made (their input shapes) and how many prompts it finished."""
    steps: list[dict] = []
    step_forward, forward = engine._step_forward, engine.model.forward

    def spy(decode, chunks, slots):
        calls = []
        engine.model.forward = lambda *a, **k: (calls.append(tuple(a[0].shape)), forward(*a, **k))[1]
        try:
            logits = step_forward(decode, chunks, slots)
        finally:
            engine.model.forward = forward
        steps.append({"decode": len(decode), "chunks": [(start, s.num_cached - start) for s, start in chunks],
                      "forwards": calls, "done": logits.shape[0] - len(decode)})
        return logits

    engine._step_forward = spy
    return steps


def test_prompts_longer_than_the_budget_give_the_unchunked_tokens(tiny, hf_greedy):
    prompts = [_ids(n, seed=n) for n in (5, 23, 40, 9, 31)]
    params = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    chunked = s11.InferenceEngine(tiny, max_batch_size=3, block_size=BS, max_num_batched_tokens=7)
    whole = s11.InferenceEngine(tiny, max_batch_size=3, block_size=BS, max_num_batched_tokens=4096)
    steps = _record_steps(chunked)
    got = [c.token_ids for c in chunked.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    assert got == [c.token_ids for c in whole.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    assert got == [hf_greedy(p, 6) for p in prompts]
    assert max(n for st in steps for _, n in st["chunks"]) <= 7 and sum(len(st["chunks"]) for st in steps) > len(prompts)
    _all_free(chunked)


def test_streams_decode_every_step_while_a_long_prompt_is_prefilled(tiny, hf_greedy):
    budget = 8
    engine = s11.InferenceEngine(tiny, max_batch_size=4, block_size=BS, max_num_batched_tokens=budget,
                                 enable_prefix_caching=False)
    sched = s11.OnlineScheduler(engine, max_batch_size=4)
    params = SamplingParams(max_new_tokens=30, stop_on_eos=False)
    stream_prompts = [_ids(3, seed=i) for i in range(3)]
    streams = [sched.add_request(prompt_token_ids=p, params=params) for p in stream_prompts]
    while any(sched.session(r).prefilling for r in streams):
        sched.step()
    steps = _record_steps(engine)
    long_prompt = _ids(41, seed=99)
    rid = sched.add_request(prompt_token_ids=long_prompt, params=SamplingParams(max_new_tokens=4, stop_on_eos=False))
    while sched.session(rid).prefilling:
        tokens = sched.step()
        assert set(streams) <= set(tokens)  # every stream got its token this step: decode is never starved
    # 41 prompt tokens, 8 - 3 = 5 of them per step: 9 steps, one forward each, each of exactly the budget
    # (the last one: 3 decode rows + the last token of the prompt).
    assert [st["chunks"] for st in steps] == [[(5 * i, 5)] for i in range(8)] + [[(40, 1)]]
    assert all(st["decode"] == 3 and len(st["forwards"]) == 1 for st in steps)
    assert [shape[1] for st in steps for shape in st["forwards"]] == [budget] * 8 + [4]
    while sched.has_unfinished():
        sched.step()
    assert sched.pop_completion(rid).token_ids == hf_greedy(long_prompt, 4)
    for r, p in zip(streams, stream_prompts):
        assert sched.pop_completion(r).token_ids == hf_greedy(p, 30)
    _all_free(engine)


def test_a_chunk_starts_at_the_first_uncached_block(tiny, hf_greedy):
    engine = s11.InferenceEngine(tiny, max_batch_size=2, block_size=BS, max_num_batched_tokens=6)
    system = _ids(5 * BS, seed=5)
    first, second = system + _ids(3, seed=6), system + _ids(9, seed=7)
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False)
    assert engine.generate([Request(prompt_token_ids=first, params=params)])[0].token_ids == hf_greedy(first, 3)
    steps = _record_steps(engine)
    assert engine.generate([Request(prompt_token_ids=second, params=params)])[0].token_ids == hf_greedy(second, 3)
    prefill = [c for st in steps for c in st["chunks"]]
    assert prefill[0] == (5 * BS, 6) and sum(n for _, n in prefill) == 9  # the 5 system blocks are not recomputed
    assert engine.prefix_cache.hit_tokens == 5 * BS
    _all_free(engine)


def test_a_burst_shares_the_blocks_an_earlier_chunk_of_the_same_step_completes(tiny, hf_greedy):
    engine = s11.InferenceEngine(tiny, max_batch_size=4, block_size=BS, max_num_batched_tokens=64)
    system = _ids(2 * BS, seed=8)
    prompts = [system + _ids(2 + i, seed=20 + i) for i in range(3)]
    steps = _record_steps(engine)
    sched = s11.OnlineScheduler(engine, max_batch_size=4)
    params = SamplingParams(max_new_tokens=4, stop_on_eos=False)
    ids = sched.add_requests([s11.OnlineRequest(prompt_token_ids=p, params=params) for p in prompts])
    while sched.has_unfinished():
        sched.step()
    assert steps[0]["chunks"] == [(0, len(prompts[0]))] + [(2 * BS, len(p) - 2 * BS) for p in prompts[1:]]
    for rid, p in zip(ids, prompts):
        assert sched.pop_completion(rid).token_ids == hf_greedy(p, 4)
    _all_free(engine)


def test_cancel_in_the_middle_of_a_chunked_prefill_frees_everything(tiny):
    engine = s11.InferenceEngine(tiny, max_batch_size=2, block_size=BS, max_num_batched_tokens=4)
    prompt = _ids(10 * BS + 2, seed=30)
    with s11.SchedulerManager(engine, max_batch_size=2) as mgr:
        chunked, go = threading.Event(), threading.Event()
        step = mgr.scheduler.step

        def held_step() -> dict[int, int]:
            out = step()
            if any(s.prefilling and s.num_cached > 0 for s in mgr.scheduler._sessions.values()):
                chunked.set()  # a chunk is in, more are to come
                go.wait(10)
            return out

        mgr.scheduler.step = held_step
        handle = mgr.add_request(prompt_token_ids=prompt, max_new_tokens=5)
        assert chunked.wait(30)
        session = next(iter(mgr.scheduler._sessions.values()))
        assert 0 < session.num_cached < len(prompt) and len(session.block_table) > 0
        handle.cancel()
        go.set()
        done = handle.result(timeout=30)
    assert done.finish_reason == "cancelled" and done.token_ids == []
    _all_free(engine)  # the full blocks its chunks wrote stay cached, evictable: free like any other


def test_randomized_submit_and_cancel_leaves_no_block_in_use(tiny, hf_greedy):
    rng = random.Random(31)
    systems = [_ids(rng.randint(BS, 6 * BS), seed=500 + i) for i in range(3)]
    engine = s11.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=48, max_num_batched_tokens=9)
    with s11.SchedulerManager(engine, max_batch_size=4, prefill_max_batch_size=3) as mgr:
        handles = []
        for i in range(24):
            prompt = rng.choice(systems) + _ids(rng.randint(1, 12), seed=600 + i)
            n = rng.randint(1, 8)
            handles.append((prompt, n, mgr.add_request(prompt_token_ids=prompt, max_new_tokens=n, stop_on_eos=False)))
            if rng.random() < 0.3:
                rng.choice(handles)[2].cancel()
        for prompt, n, h in handles:
            done = h.result(timeout=60)
            if done.finish_reason != "cancelled":
                assert done.token_ids == hf_greedy(prompt, n)
    assert engine.prefix_cache.hits > 0
    _all_free(engine)


def test_a_budget_below_the_decode_batch_is_refused(tiny):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s11.InferenceEngine(tiny, max_batch_size=8, max_num_batched_tokens=4)
    engine = s11.InferenceEngine(tiny, max_batch_size=2, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s11.OnlineScheduler(engine, max_batch_size=8)
