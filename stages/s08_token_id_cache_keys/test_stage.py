"""Stage 08's own idea: the prefix cache and in-batch dedup key a request by its token ids when it has them.

Cross-stage parity is in tests/test_parity.py. Here: the post's test (three requests with
different text and the same `prompt_token_ids` cost ONE prefill forward — by in-batch dedup with
the cache off, and with it on), a text-only request keeping the string key, the key of a prompt
longer than the context being its last `max_position_embeddings` ids (exactly what is prefilled),
and a token-id hit across bursts giving the tokens of a miss.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams, prepare_prompt
from common.tokenizer import encode
from stages.s08_token_id_cache_keys import InferenceEngine, OnlineRequest, OnlineScheduler, SchedulerManager


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ForwardSpy:
    """Stands in for engine.model (never the shared model itself): records the shape of every prefill."""

    def __init__(self, model) -> None:
        self.model, self.prefills = model, []

    def __call__(self, input_ids, positions, attention, logits_indices=None):
        if type(attention).__name__ == "PrefillAttention":
            self.prefills.append(tuple(input_ids.shape))
        return self.model(input_ids, positions, attention, logits_indices=logits_indices)


def _spy(engine: InferenceEngine) -> ForwardSpy:
    engine.model = ForwardSpy(engine.model)
    return engine.model


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _run(sched: OnlineScheduler, rids: list[int]) -> list[list[int]]:
    while sched.has_unfinished():
        sched.step()
    return [sched.pop_completion(rid).token_ids for rid in rids]


def _assert_pool_empty(engine: InferenceEngine) -> None:
    engine.prefix_cache.clear()
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0
    assert alloc.ref_counts == [0] * alloc.num_blocks


@pytest.mark.parametrize("entries", [64, 0])
def test_different_text_same_token_ids_is_one_prefill(tiny, hf_greedy, entries):
    """The post's test: prompt "a", "b", "c" with the same prompt_token_ids -> forward_calls == 1."""
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4, prefix_cache_max_entries=entries)
    spy = _spy(engine)
    sched = OnlineScheduler(engine, max_batch_size=4)
    ids = _ids(7, seed=1)
    rids = sched.add_requests([OnlineRequest(prompt=t, prompt_token_ids=list(ids), params=SamplingParams(max_new_tokens=6))
                               for t in ("a", "b", "c")])
    assert spy.prefills == [(1, 7)]  # exactly one prefill forward, of one row
    assert all(t == hf_greedy(ids, 6) for t in _run(sched, rids))
    assert len(engine.prefix_cache) == (1 if entries else 0)
    if entries:
        assert tuple(ids) in engine.prefix_cache and "a" not in engine.prefix_cache
    _assert_pool_empty(engine)


def test_token_id_hit_across_bursts_gives_the_tokens_of_a_miss(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4)
    spy = _spy(engine)
    sched = OnlineScheduler(engine, max_batch_size=4)
    ids = _ids(10, seed=2)
    params = SamplingParams(max_new_tokens=8, stop_on_eos=False)
    [miss] = _run(sched, sched.add_requests([OnlineRequest(prompt="x", prompt_token_ids=ids, params=params)]))
    assert len(spy.prefills) == 1
    rids = sched.add_requests([OnlineRequest(prompt="y", prompt_token_ids=list(ids), params=params),
                               OnlineRequest(prompt_token_ids=list(ids), params=params)])  # no text at all
    assert len(spy.prefills) == 1  # both were hits: no forward
    assert _run(sched, rids) == [miss, miss] and miss == hf_greedy(ids, 8)
    assert (engine.prefix_cache.hits, engine.prefix_cache.misses) == (2, 1)
    _assert_pool_empty(engine)


def test_text_only_request_keeps_the_string_key(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=2, block_size=4)
    spy = _spy(engine)
    text = "Tell me a story about a cat"
    by_text = Request(prompt=text, params=SamplingParams(max_new_tokens=5))
    by_ids = Request(prompt=text, prompt_token_ids=encode(tiny.tokenizer, text), params=SamplingParams(max_new_tokens=5))
    session = engine.new_session(by_text, prepare_prompt(by_text, tiny.tokenizer, engine.max_model_len))
    assert engine.prefix_cache_key(session) == text
    session = engine.new_session(by_ids, prepare_prompt(by_ids, tiny.tokenizer, engine.max_model_len))
    assert engine.prefix_cache_key(session) == tuple(by_ids.prompt_token_ids)
    done = engine.generate([by_text]) + engine.generate([by_text])
    assert len(spy.prefills) == 1 and list(engine.prefix_cache._entries) == [text]  # the text hit itself
    engine.generate([by_ids])  # a different key: its own entry
    assert len(spy.prefills) == 2 and len(engine.prefix_cache) == 2
    assert done[0].token_ids == done[1].token_ids == hf_greedy(by_ids.prompt_token_ids, 5)
    _assert_pool_empty(engine)


def test_long_prompt_key_is_its_last_max_position_embeddings_ids(tiny, hf_greedy):
    max_len = tiny.config.max_position_embeddings
    engine = InferenceEngine(tiny, max_batch_size=2, block_size=16, kv_cache_max_concurrency=3)
    spy = _spy(engine)
    tail = _ids(max_len, seed=3)
    long_a, long_b = _ids(20, seed=4) + tail, _ids(35, seed=5) + tail  # differ only before the window
    req = Request(prompt_token_ids=long_a, params=SamplingParams(max_new_tokens=4))
    session = engine.new_session(req, prepare_prompt(req, tiny.tokenizer, max_len))
    assert engine.prefix_cache_key(session) == tuple(long_a[-max_len:]) == tuple(tail)
    [a] = engine.generate([req])
    assert spy.prefills == [(1, max_len)] and tuple(tail) in engine.prefix_cache
    [b] = engine.generate([Request(prompt_token_ids=long_b, params=SamplingParams(max_new_tokens=4))])
    assert len(spy.prefills) == 1  # the same window: a hit
    assert a.truncated and b.truncated and a.prompt_token_ids == b.prompt_token_ids == tail
    assert a.token_ids == b.token_ids == hf_greedy(tail, 1)  # the window is full: one token
    _assert_pool_empty(engine)


def test_manager_requests_with_equal_ids_share_one_prefill(tiny, hf_greedy):
    """Post 004's benchmark shape: the texts all differ, the pre-tokenized ids are equal."""
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4)
    spy = _spy(engine)
    ids = _ids(5, seed=6)
    with SchedulerManager(engine, max_batch_size=4, prefill_max_batch_size=4) as mgr:
        first = mgr.add_request("Hello 0", prompt_token_ids=list(ids), max_new_tokens=3).result(timeout=60)
        later = [mgr.add_request(f"Hello {i}", prompt_token_ids=list(ids), max_new_tokens=3) for i in range(1, 6)]
        results = [h.result(timeout=60) for h in later]
    assert len(spy.prefills) == 1
    assert all(r.token_ids == first.token_ids == hf_greedy(ids, 3) for r in results)
    assert [r.prompt for r in results] == [f"Hello {i}" for i in range(1, 6)]  # each keeps its own text
    _assert_pool_empty(engine)
