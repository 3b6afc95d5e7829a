"""Stage 05's own idea: a repeated prompt reuses its cached KV blocks and last logits — no prefill.

Cross-stage parity is in tests/test_parity.py. Here: a hit gives exactly the tokens of a miss
(prompt lengths on and off block boundaries) without a single prefill forward; the LRU order
and `prefix_cache_max_entries` (0 disables); copy-on-write of a shared, partly filled last
block; eviction that frees blocks only once no session holds them; the pool short of blocks
evicting entries instead of failing; and every block back after finished, cancelled and
failed requests.
"""

from __future__ import annotations

import threading

import pytest
import torch

from common.requests import Request, SamplingParams
from common.tokenizer import encode
from stages.s05_prefix_cache import InferenceEngine, OnlineScheduler, OutOfKVBlocks, SchedulerManager

P7 = "Tell me a story about a cat"  # 7 tokens
P12 = "one two three four five six seven eight nine ten eleven twelve"  # 12 tokens
P16 = "The quick brown fox jumps over the lazy dog and then runs away into the forest"  # 16 tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ForwardSpy:
    """Stands in for engine.model (never the shared model itself): records every forward."""

    def __init__(self, model, fail_on_first_token: int | None = None) -> None:
        self.model, self.fail_on_first_token, self.calls = model, fail_on_first_token, []

    def __call__(self, input_ids, positions, attention, logits_indices=None):
        self.calls.append((type(attention).__name__, tuple(input_ids.shape)))
        if self.fail_on_first_token is not None and int(input_ids[0, 0]) == self.fail_on_first_token:
            raise RuntimeError("injected prefill failure")
        return self.model(input_ids, positions, attention, logits_indices=logits_indices)

    @property
    def prefills(self) -> int:
        return sum(name == "PrefillAttention" for name, _ in self.calls)


def _spy(engine: InferenceEngine, **kw) -> ForwardSpy:
    engine.model = ForwardSpy(engine.model, **kw)
    return engine.model


def _req(prompt: str, n: int = 10, **params) -> Request:
    return Request(prompt=prompt, params=SamplingParams(max_new_tokens=n, **params))


def _assert_pool_empty(engine: InferenceEngine) -> None:
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0
    assert alloc.ref_counts == [0] * alloc.num_blocks


@pytest.mark.parametrize("block_size", [4, 16])
def test_hit_gives_the_tokens_of_a_miss_without_a_prefill(tiny, hf_greedy, block_size):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=block_size)
    prompts = [P16, P12, P7]
    lengths = [len(encode(tiny.tokenizer, p)) for p in prompts]
    assert lengths == [16, 12, 7]
    assert {n % block_size == 0 for n in lengths} == {True, False}  # full and partial last blocks
    spy = _spy(engine)
    for prompt in prompts:
        [miss] = engine.generate([_req(prompt)])
        assert spy.prefills == 1 and prompt in engine.prefix_cache
        spy.calls.clear()
        [hit] = engine.generate([_req(prompt)])
        assert spy.prefills == 0  # the cached blocks and logits were attached: no prefill forward
        assert all(shape[1] == 1 for _, shape in spy.calls)  # only one-token decode steps
        assert hit.token_ids == miss.token_ids == hf_greedy(miss.prompt_token_ids, 10)
        spy.calls.clear()
    stats = engine.kv_stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_misses"], stats["prefix_cache_entries"]) == (3, 3, 3)
    engine.prefix_cache.clear()
    _assert_pool_empty(engine)


def test_lru_order_and_max_entries(tiny):
    engine = InferenceEngine(tiny, max_batch_size=2, prefix_cache_max_entries=2)
    spy = _spy(engine)
    for prompt in ["A", "B", "A", "C"]:  # A is touched again, so B is the least recently used
        engine.generate([_req(prompt, 2)])
    assert spy.prefills == 3
    assert list(engine.prefix_cache._entries) == ["A", "C"]  # B evicted; LRU -> MRU order
    engine.generate([_req("B", 2)])  # a miss again: prefilled, and now A is the LRU one
    assert spy.prefills == 4 and list(engine.prefix_cache._entries) == ["C", "B"]
    assert (engine.prefix_cache.hits, engine.prefix_cache.misses) == (1, 4)


def test_zero_entries_disables_the_cache(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, prefix_cache_max_entries=0)
    spy = _spy(engine)
    done = engine.generate([_req(P7, 6)] * 3) + engine.generate([_req(P7, 6)])
    assert spy.prefills == 4 and len(engine.prefix_cache) == 0  # every request prefilled
    assert all(c.token_ids == hf_greedy(c.prompt_token_ids, 6) for c in done)
    assert engine.kv_stats()["prefix_cache_hits"] == 0
    _assert_pool_empty(engine)  # nothing kept


def test_token_id_only_prompts_are_not_cached(tiny):
    engine = InferenceEngine(tiny, max_batch_size=2)  # the key is the prompt string (as in the post)
    spy = _spy(engine)
    ids = encode(tiny.tokenizer, P7)
    engine.generate([Request(prompt_token_ids=ids, params=SamplingParams(max_new_tokens=2))] * 2)
    assert spy.prefills == 2 and len(engine.prefix_cache) == 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_copy_on_write_keeps_live_sessions_and_the_entry_apart(tiny, hf_greedy, block_size):
    """A greedy and a sampled session share the cached prompt's partial last block while both decode."""
    assert len(encode(tiny.tokenizer, P7)) % block_size != 0
    sampled = dict(do_sample=True, temperature=1.5, seed=7, stop_on_eos=False)
    reqs = [_req(P7, 12, stop_on_eos=False), _req(P7, 12, **sampled), _req(P7, 5, stop_on_eos=False)]
    reference = InferenceEngine(tiny, max_batch_size=4, block_size=block_size, prefix_cache_max_entries=0).generate(reqs)
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=block_size)
    spy = _spy(engine)
    greedy, sample, short = engine.generate(reqs)  # the 1st misses, the other two attach and decode beside it
    assert spy.prefills == 1 and engine.prefix_cache.hits == 2
    assert sample.token_ids != greedy.token_ids  # really different K/V written after the shared prompt
    assert greedy.token_ids == hf_greedy(greedy.prompt_token_ids, 12)
    assert sample.token_ids == reference[1].token_ids  # the same seeded draw as without any sharing
    assert short.token_ids == greedy.token_ids[:5]
    [later] = engine.generate([_req(P7, 12, stop_on_eos=False)])  # the entry itself is intact
    assert spy.prefills == 1 and later.token_ids == greedy.token_ids
    engine.prefix_cache.clear()
    _assert_pool_empty(engine)


def test_evicted_blocks_come_back_only_when_no_session_holds_them(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=2, block_size=4)
    alloc = engine.pool.allocator
    engine.generate([_req(P7, 2)])  # cached: 2 blocks, held by the cache alone
    sched = OnlineScheduler(engine, max_batch_size=2)
    rid = sched.add_request(P7, max_new_tokens=8, stop_on_eos=False)  # a hit: shares the 2 blocks
    cached = list(engine.prefix_cache._entries[P7].block_table)
    assert sched.session(rid).block_table == cached and all(alloc.ref_counts[b] == 2 for b in cached)
    free = alloc.num_free
    assert engine.prefix_cache.evict_one() and len(engine.prefix_cache) == 0
    assert alloc.num_free == free  # still in use by the live session: nothing returned
    assert all(alloc.ref_counts[b] == 1 for b in cached)
    while sched.has_unfinished():
        sched.step()
    assert sched.pop_completion(rid).token_ids == hf_greedy(encode(tiny.tokenizer, P7), 8)
    _assert_pool_empty(engine)  # the session let go: now the blocks are back


def test_reserve_evicts_entries_when_the_pool_is_short(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=1, block_size=4, num_kv_blocks=6)
    alloc = engine.pool.allocator
    engine.generate([_req(P12, 4)])  # the cache keeps its 3 blocks
    assert P12 in engine.prefix_cache and alloc.num_available == 3
    sched = OnlineScheduler(engine, max_batch_size=2)
    rid = sched.add_request(P16, max_new_tokens=4)  # needs 5 + 1 blocks: only by evicting P12
    assert P12 not in engine.prefix_cache and P16 in engine.prefix_cache
    booked = alloc.reserved
    with pytest.raises(OutOfKVBlocks):  # evicting P16 frees nothing: its blocks are the live session's
        sched.add_request(P7, max_new_tokens=2)
    assert alloc.reserved == booked and len(engine.prefix_cache) == 0  # the failure booked nothing
    while sched.has_unfinished():
        sched.step()
    assert sched.pop_completion(rid).token_ids == hf_greedy(encode(tiny.tokenizer, P16), 4)
    _assert_pool_empty(engine)


def test_manager_every_block_returns_after_finished_cancelled_and_failed(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4)
    spy = _spy(engine, fail_on_first_token=7777)
    mgr = SchedulerManager(engine, max_batch_size=4)
    step_gate, stepped = threading.Event(), threading.Event()
    step = mgr.scheduler.step

    def gated_step():  # the long request cannot finish before the test cancels it
        stepped.set()
        step_gate.wait(10)
        return step()

    mgr.scheduler.step = gated_step
    try:
        long = mgr.add_request(P16, params=SamplingParams(max_new_tokens=100, stop_on_eos=False))
        assert stepped.wait(10)
        bad = [mgr.add_request(""), mgr.add_request("x", max_new_tokens=0),
               mgr.add_request(prompt_token_ids=[7777, 1, 2], max_new_tokens=3)]  # prefill raises
        mgr.cancel(long.request_id)
        step_gate.set()
        good = [mgr.add_request(P7, max_new_tokens=6) for _ in range(3)]
        cancelled = long.result(timeout=30)
        assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 100
        for handle, err in zip(bad, ["prompt", "max_new_tokens", "injected"]):
            with pytest.raises((ValueError, RuntimeError), match=err):
                handle.result(timeout=30)
        for handle in good:
            done = handle.result(timeout=30)
            assert done.token_ids == hf_greedy(done.prompt_token_ids, 6)
    finally:
        step_gate.set()
        mgr.close()
    assert spy.prefills == 3  # P16, the failing one, and P7 once: the other two P7s were hits
    alloc = engine.pool.allocator
    held = sum(len(e.block_table) for e in engine.prefix_cache._entries.values())
    assert held > 0 and alloc.num_free == alloc.num_blocks - held and alloc.reserved == 0
    engine.prefix_cache.clear()
    _assert_pool_empty(engine)


def test_cache_on_and_off_give_identical_tokens(tiny, hf_greedy):
    prompts = [P7, P12, P7, P16, P12, P7]
    reqs = [_req(p, 3 + i) for i, p in enumerate(prompts)]
    reqs.append(_req(P12, 8, do_sample=True, top_k=20, seed=3, stop_on_eos=False))  # sampled from cached logits
    on = InferenceEngine(tiny, max_batch_size=3, block_size=4).generate(reqs)
    off = InferenceEngine(tiny, max_batch_size=3, block_size=4, prefix_cache_max_entries=0).generate(reqs)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    for r, c in zip(reqs[:-1], on):
        assert c.token_ids == hf_greedy(c.prompt_token_ids, r.params.max_new_tokens)


def test_same_text_with_different_token_ids_is_not_a_false_hit(tiny, hf_greedy):
    """The key is the text, but an entry remembers its tokens: a different tokenization is a miss."""
    engine = InferenceEngine(tiny, max_batch_size=2, block_size=4)
    ids_a, ids_b = encode(tiny.tokenizer, "The capital of France is"), encode(tiny.tokenizer, "Bonjour à tous")
    first = engine.generate([Request(prompt="same text", prompt_token_ids=ids_a, params=SamplingParams(max_new_tokens=6))])
    second = engine.generate([Request(prompt="same text", prompt_token_ids=ids_b, params=SamplingParams(max_new_tokens=6))])
    assert first[0].token_ids == hf_greedy(ids_a, 6)
    assert second[0].token_ids == hf_greedy(ids_b, 6)  # not ids_a's continuation from the cached entry
    assert engine.prefix_cache.hits == 0
