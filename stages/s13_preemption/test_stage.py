"""Stage 13's own idea: KV blocks taken as sequences grow, and preemption by recompute when the pool runs dry.

Cross-stage parity is in tests/test_parity.py. Here: admission books only a prompt's blocks; a
roomy pool never preempts; a tight one preempts and every request still gets exactly the tokens
transformers gives (greedy, fp32), streamed once each, in order; a preemption in the middle of a
chunked prefill, of a prefix-cache hit, or right after a cancel loses nothing; a randomized
submit/cancel run under a tiny pool leaves every block free and the cache consistent; a prompt
that can never fit is refused at once, and a request that outgrows the whole pool ends with an
error, never a hang. The engines run the CUDA graphs' padded path (enforce_eager=False: on a
CPU, the same function called eagerly), the path a GPU takes; two tests run a CPU's default eager
path too.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams
from stages import s13_preemption as s13

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


def _run(engine, prompts, new_tokens):
    params = [SamplingParams(max_new_tokens=n, stop_on_eos=False) for n in new_tokens]
    return [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params)])]


def test_admission_books_the_prompt_not_the_worst_case(tiny) -> None:
    engine = s13.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=64, enforce_eager=False)
    sched = s13.OnlineScheduler(engine, max_batch_size=4)
    rid = sched.add_request(prompt_token_ids=_ids(9, seed=1), params=SamplingParams(max_new_tokens=100, stop_on_eos=False))
    assert engine.pool.allocator.reserved == 3  # 9 tokens: 3 blocks of 4, not the 28 of 109 tokens
    sched.step()  # the prefill takes its booked blocks
    assert engine.pool.allocator.reserved == 0 and len(sched.session(rid).block_table) == 3
    for _ in range(4):
        sched.step()  # 9 + 4 tokens cached: the 4th decode token started a 4th block, taken then
    assert len(sched.session(rid).block_table) == 4


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "padded"])  # a CPU's default; a GPU's path
def test_a_roomy_pool_never_preempts_and_a_tight_one_gives_the_same_tokens(enforce_eager, tiny, hf_greedy) -> None:
    prompts = [_ids(3 + 2 * i, seed=i) for i in range(8)]
    new_tokens = [30 + 3 * i for i in range(8)]
    roomy = s13.InferenceEngine(tiny, max_batch_size=8, block_size=BS, num_kv_blocks=200, enforce_eager=enforce_eager)
    tight = s13.InferenceEngine(tiny, max_batch_size=8, block_size=BS, num_kv_blocks=24, enforce_eager=enforce_eager)
    expected = [hf_greedy(p, n) for p, n in zip(prompts, new_tokens)]
    assert _run(roomy, prompts, new_tokens) == expected
    assert roomy.kv_stats()["num_preemptions"] == 0
    assert _run(tight, prompts, new_tokens) == expected
    stats = tight.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["recomputed_tokens"] > 0 and stats["kv_usage_peak"] > 0.9
    # Forced: a pool just large enough for the longest request alone (its last token is never written)
    just = max(-(-(len(p) + n - 1) // BS) for p, n in zip(prompts, new_tokens))
    forced = s13.InferenceEngine(tiny, max_batch_size=8, block_size=BS, num_kv_blocks=just, enforce_eager=enforce_eager)
    assert _run(forced, prompts, new_tokens) == expected
    assert forced.kv_stats()["num_preemptions"] > 0
    for engine in (roomy, tight, forced):
        _all_free(engine)


def test_a_preempted_stream_gets_every_token_once_in_order(tiny, hf_greedy) -> None:
    engine = s13.InferenceEngine(tiny, max_batch_size=6, block_size=BS, num_kv_blocks=20, enforce_eager=False)
    prompts = [_ids(4 + i, seed=20 + i) for i in range(6)]
    with s13.SchedulerManager(engine, max_batch_size=6, stream_interval=1) as mgr:
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=25, stop_on_eos=False) for p in prompts]
        streamed = [[t for chunk in h for t in chunk.token_ids] for h in handles]
        done = [h.result(timeout=60) for h in handles]
    assert engine.kv_stats()["num_preemptions"] > 0
    for p, got, d in zip(prompts, streamed, done):
        assert got == d.token_ids == hf_greedy(p, 25)  # no gap, no duplicate, the unpreempted tokens
    _all_free(engine)


def test_preempted_in_the_middle_of_a_chunked_prefill(tiny, hf_greedy) -> None:
    """Two streams decode; a long prompt, admitted last, is being prefilled in chunks when the
    streams need blocks: it is the victim, and comes back to prefill again from what is cached.

    14 blocks of 4. The streams hold 3 blocks each (12 tokens) when the 22-token prompt books its
    6, which leaves exactly one spare block per stream. Four tokens later both streams start a
    block again, with the prompt 16 tokens into its prefill (4 a step): the pool is dry."""
    engine = s13.InferenceEngine(tiny, max_batch_size=3, block_size=BS, num_kv_blocks=14, max_num_batched_tokens=6,
                                 enforce_eager=False)
    sched = s13.OnlineScheduler(engine, max_batch_size=3)
    stream_prompts = [_ids(3, seed=30 + i) for i in range(2)]
    streams = [sched.add_request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=20, stop_on_eos=False))
               for p in stream_prompts]
    while sched.session(streams[0]).num_cached < 12:
        sched.step()
    long_prompt = _ids(22, seed=33)
    rid = sched.add_request(prompt_token_ids=long_prompt, params=SamplingParams(max_new_tokens=5, stop_on_eos=False))
    long = sched.session(rid)
    seen_mid_prefill = False
    while sched.has_unfinished():
        was = (long.prefilling, long.num_cached)
        sched.step()
        seen_mid_prefill |= long.preempted and was[0] and 0 < was[1] < len(long_prompt)
    assert seen_mid_prefill and long.preemptions > 0
    # Its prompt was no hit (nothing of it was cached when it came): the blocks of its own that its
    # readmission took back are no hits either (they made hit_tokens exceed query_tokens).
    assert engine.prefix_cache.hit_tokens == 0 and long.reused_blocks > 0
    assert sched.pop_completion(rid).token_ids == hf_greedy(long_prompt, 5)
    for r, p in zip(streams, stream_prompts):
        assert sched.pop_completion(r).token_ids == hf_greedy(p, 20)
    _all_free(engine)


def test_a_readmission_takes_back_what_the_prefix_cache_still_holds(tiny, hf_greedy) -> None:
    """A preempted session's full blocks go into the prefix cache; readmitted while nobody has
    needed them, its recompute takes them back instead of computing them."""
    engine = s13.InferenceEngine(tiny, max_batch_size=2, block_size=BS, num_kv_blocks=40, enforce_eager=False)
    sched = s13.OnlineScheduler(engine, max_batch_size=2)
    prompt = _ids(10, seed=40)
    rid = sched.add_request(prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=12, stop_on_eos=False))
    for _ in range(7):
        sched.step()  # prefill + 6 decode steps: 16 tokens cached, 4 full blocks
    session = sched.session(rid)
    assert session.num_cached == 16 and session.reused_blocks == 0
    hits_before = engine.prefix_cache.hit_tokens
    engine.preempt(session)
    sched._preempted.insert(0, rid)
    while sched.has_unfinished():
        sched.step()
    assert sched.pop_completion(rid).token_ids == hf_greedy(prompt, 12)
    # its 4 full blocks came back from the cache: nothing it had computed was computed again (the
    # 17th token, the last generated, never had K/V: the readmission computes it for the first time)
    assert session.reused_blocks == 4 and engine.recomputed_tokens == 0
    assert engine.prefix_cache.hit_tokens == hits_before  # statistics count a prompt once, not its readmissions
    _all_free(engine)


def test_preemption_right_after_a_cancel(tiny, hf_greedy) -> None:
    engine = s13.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=16, enforce_eager=False)
    prompts = [_ids(5, seed=50 + i) for i in range(4)]
    with s13.SchedulerManager(engine, max_batch_size=4) as mgr:
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=24, stop_on_eos=False) for p in prompts]
        next(iter(handles[1]))  # it has started streaming
        handles[1].cancel()
        results = [h.result(timeout=60) for h in handles]
    assert results[1].finish_reason == "cancelled"
    assert engine.kv_stats()["num_preemptions"] > 0  # 3 x 8 blocks still want more than the pool's 16
    for i in (0, 2, 3):
        assert results[i].token_ids == hf_greedy(prompts[i], 24)
    _all_free(engine)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "padded"])
def test_randomized_submit_and_cancel_under_a_tiny_pool(enforce_eager, tiny, hf_greedy) -> None:
    rng = random.Random(61)
    systems = [_ids(rng.randint(BS, 3 * BS), seed=600 + i) for i in range(3)]
    engine = s13.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=18, max_num_batched_tokens=9,
                                 enforce_eager=enforce_eager)
    with s13.SchedulerManager(engine, max_batch_size=4, prefill_max_batch_size=3) as mgr:
        handles = []
        for i in range(24):
            prompt = rng.choice(systems) + _ids(rng.randint(1, 8), seed=700 + i)
            n = rng.randint(1, 20)
            handles.append((prompt, n, mgr.add_request(prompt_token_ids=prompt, max_new_tokens=n, stop_on_eos=False)))
            if rng.random() < 0.25:
                rng.choice(handles)[2].cancel()
        for prompt, n, h in handles:
            done = h.result(timeout=120)
            expected = hf_greedy(prompt, n)
            assert done.token_ids == (expected if done.finish_reason != "cancelled" else expected[: len(done.token_ids)])
    assert engine.kv_stats()["num_preemptions"] > 0 and engine.prefix_cache.hits > 0
    _all_free(engine)


def test_a_prompt_that_never_fits_and_a_request_that_outgrows_the_pool(tiny, hf_greedy) -> None:
    engine = s13.InferenceEngine(tiny, max_batch_size=2, block_size=BS, num_kv_blocks=4, enforce_eager=False)
    with pytest.raises(ValueError, match="^prompt: a request's prompt needs 5 KV blocks"):
        _run(engine, [_ids(16, seed=1)], [4])  # 16 + 1 tokens: 5 blocks of 4
    # One new token: the prompt fills the pool exactly (the token it samples is never written back)
    assert _run(engine, [_ids(16, seed=1)], [1]) == [hf_greedy(_ids(16, seed=1), 1)]
    with pytest.raises(ValueError, match="max_new_tokens: request .* past the whole KV pool"):
        _run(engine, [_ids(3, seed=2), _ids(2, seed=5)], [40, 3])  # the first outgrows 16 tokens alone
    _all_free(engine)  # the other request's blocks went back too: the engine serves the next call whole
    assert _run(engine, [_ids(2, seed=5)], [3]) == [hf_greedy(_ids(2, seed=5), 3)]
    with s13.SchedulerManager(engine, max_batch_size=2, stream_interval=4) as mgr:
        prompt = _ids(3, seed=3)
        grows = mgr.add_request(prompt_token_ids=prompt, max_new_tokens=40, stop_on_eos=False)
        streamed = []
        with pytest.raises(ValueError, match="max_new_tokens: request .* past the whole KV pool"):
            for chunk in grows:
                streamed += chunk.token_ids
        assert streamed == hf_greedy(prompt, 14)  # every token it made (16 - 3 cached, +1) before the pool ran out, none held back
        fine = mgr.add_request(prompt_token_ids=_ids(3, seed=4), max_new_tokens=5, stop_on_eos=False)
        assert len(fine.result(timeout=60).token_ids) == 5  # the worker goes on
    _all_free(engine)
