"""Stage 10's own idea: prompts that share leading full blocks share their K/V.

Cross-stage parity is in tests/test_parity.py. Here: greedy tokens equal transformers' and a
cache-off run, with partial hits (a shared system prompt, different questions); a burst shares
the blocks its first prompt writes in the same forward; an exact repeat recomputes only the
last block; under pressure cached blocks are evicted tail first and everything stays correct;
a randomized submit/cancel run leaves every block free and the cache consistent.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams
from stages import s10_block_prefix_cache as s10

BS = 4  # small blocks: many of them in short prompts


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
    """No session holds a block: every block is free (plain or cached-evictable), nothing booked."""
    alloc = engine.pool.allocator
    assert alloc.reserved == 0
    assert alloc.num_free == alloc.num_blocks and not any(alloc.ref_counts)
    cache = engine.prefix_cache
    assert set(cache._key_of) == alloc.cached  # the cache and the allocator agree on what is cached
    assert all(cache._block_of[k] == b for b, k in cache._key_of.items())


def _generate(engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new, stop_on_eos=False)
    return [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]


def test_block_keys_chain_the_prefix():
    a, b = _ids(10, 1), _ids(10, 2)
    keys = s10.block_keys(a, BS)
    assert len(keys) == 2  # full blocks only: tokens 8, 9 are a partial block
    assert s10.block_keys(a[:8] + b, BS)[:2] == keys  # same leading blocks, same keys
    assert s10.block_keys(b[:4] + a[4:], BS)[1] != keys[1]  # same block 1, other block 0: another key


def test_shared_system_prompt_reuses_its_blocks_and_matches_transformers(tiny, hf_greedy):
    system = _ids(4 * BS + 2, seed=7)  # 4 full blocks and 2 tokens of a fifth
    prompts = [system + _ids(3 + i, seed=100 + i) for i in range(5)]
    engine = s10.InferenceEngine(tiny, max_batch_size=2, block_size=BS)
    off = s10.InferenceEngine(tiny, max_batch_size=2, block_size=BS, enable_prefix_caching=False)
    got = _generate(engine, prompts, 6)
    assert got == _generate(off, prompts, 6) == [hf_greedy(p, 6) for p in prompts]
    # generate() prefills one admitted request at a time: the first computes everything, each
    # later one finds the 4 full system-prompt blocks (the 5th block is partial and private).
    cache = engine.prefix_cache
    assert (cache.hits, cache.misses, cache.hit_tokens) == (4, 1, 4 * 4 * BS)
    assert (off.prefix_cache.hits, off.prefix_cache.hit_tokens, len(off.prefix_cache)) == (0, 0, 0)
    _all_free(engine)
    _all_free(off)


def test_a_burst_shares_the_blocks_its_first_prompt_writes_in_the_same_forward(tiny, hf_greedy):
    engine = s10.InferenceEngine(tiny, max_batch_size=4, block_size=BS)
    system = _ids(3 * BS, seed=8)
    prompts = [system + _ids(2 + i, seed=200 + i) for i in range(4)]
    spans = []
    forward = engine._prefill_forward

    def recording_forward(sessions, starts, slots):
        spans.append([len(s.prompt_ids) - start for s, start in zip(sessions, starts)])
        return forward(sessions, starts, slots)

    engine._prefill_forward = recording_forward
    sched = s10.OnlineScheduler(engine, max_batch_size=4)
    params = SamplingParams(max_new_tokens=5, stop_on_eos=False)
    ids = sched.add_requests([s10.OnlineRequest(prompt_token_ids=p, params=params) for p in prompts])
    assert spans == [[len(prompts[0])] + [len(p) - 3 * BS for p in prompts[1:]]]  # one forward; the prefix once
    tables = [sched.session(i).block_table for i in ids]
    assert all(t[:3] == tables[0][:3] for t in tables)  # the same three physical blocks
    assert all(engine.pool.allocator.ref_counts[b] == 4 for b in tables[0][:3])
    while sched.has_unfinished():
        sched.step()
    for rid, p in zip(ids, prompts):
        assert sched.pop_completion(rid).token_ids == hf_greedy(p, 5)
    _all_free(engine)


@pytest.mark.parametrize("extra", [0, 3])
def test_an_exact_repeat_recomputes_only_its_last_block(tiny, hf_greedy, extra):
    """The last prompt token is always computed (its logits are sampled): an aligned prompt
    recomputes its last full block, an unaligned one just its partial block."""
    prompt = _ids(3 * BS + extra, seed=9)
    engine = s10.InferenceEngine(tiny, max_batch_size=2, block_size=BS)
    assert _generate(engine, [prompt], 4) == [hf_greedy(prompt, 4)]
    before = engine.prefix_cache.hit_tokens
    assert _generate(engine, [prompt], 4) == [hf_greedy(prompt, 4)]
    hit = engine.prefix_cache.hit_tokens - before
    assert hit == (2 * BS if extra == 0 else 3 * BS)
    _all_free(engine)


def test_eviction_under_pressure_takes_cached_tails_first_and_stays_correct(tiny, hf_greedy):
    # 12 blocks. a: 6 full prompt blocks + 1 for its decoded token; b: 7 + 1.
    engine = s10.InferenceEngine(tiny, max_batch_size=1, block_size=BS, num_kv_blocks=12)
    alloc, cache = engine.pool.allocator, engine.prefix_cache
    a, b = _ids(6 * BS, seed=10), _ids(7 * BS, seed=11)
    assert _generate(engine, [a], 2) == [hf_greedy(a, 2)]
    a_blocks = sorted(alloc.cached)
    assert len(a_blocks) == 6 and alloc.num_evictable == 6  # cached, held by nobody, still free
    assert _generate(engine, [b], 2) == [hf_greedy(b, 2)]  # needs 8 of 12: the 6 plain free + 2 of a's evicted
    keys_a = s10.block_keys(a, BS)
    left = [k in cache._block_of for k in keys_a]
    assert left == [True] * 4 + [False] * 2  # a's tail went first; its head is still usable
    hit_before = cache.hit_tokens
    assert _generate(engine, [a], 2) == [hf_greedy(a, 2)]  # a partial hit on what survived
    assert cache.hit_tokens - hit_before == 4 * BS
    _all_free(engine)


def test_a_hit_on_an_evictable_block_is_booked_like_an_allocation(tiny):
    """Reviving a cached block nobody holds takes it out of the free blocks: without booking it,
    another request's reserved blocks would run out half-way."""
    engine = s10.InferenceEngine(tiny, max_batch_size=2, block_size=BS, num_kv_blocks=8)
    alloc = engine.pool.allocator
    prompt = _ids(3 * BS + 1, seed=12)
    _generate(engine, [prompt], 1)
    assert alloc.num_evictable == 3
    session = engine.new_session(Request(prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=3)),
                                 _prepared(engine, prompt))
    engine.reserve(session)  # needs ceil((13 + 3) / 4) = 4 blocks: 3 cached (revived) + 1 new
    assert session.block_table == sorted(alloc.cached, key=session.block_table.index)
    assert session.reserved == 1 and alloc.reserved == 1 and alloc.num_free == 5
    assert alloc.num_available == 4
    session.release_kv_blocks()
    _all_free(engine)


def _prepared(engine, prompt):
    from common.requests import prepare_prompt
    return prepare_prompt(Request(prompt_token_ids=prompt), engine.tokenizer, engine.max_model_len)


def test_randomized_submit_and_cancel_leaves_no_block_in_use(tiny, hf_greedy):
    rng = random.Random(13)
    systems = [_ids(rng.randint(BS, 5 * BS), seed=300 + i) for i in range(3)]
    engine = s10.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=40)
    with s10.SchedulerManager(engine, max_batch_size=4, prefill_max_batch_size=3) as mgr:
        handles = []
        for i in range(24):
            prompt = rng.choice(systems) + _ids(rng.randint(1, 6), seed=400 + i)
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
    engine.prefix_cache.clear()
    assert len(engine.prefix_cache) == 0 and engine.pool.allocator.num_evictable == 0
    _all_free(engine)
