"""Stage 04's own idea: continuous batching (OnlineScheduler) behind a streaming worker (SchedulerManager).

Cross-stage parity of `generate` is in tests/test_parity.py. Here: requests joining between
steps decode exactly what transformers does, round-robin when there are more sessions than
decode slots, blocks given back the step a request ends (finished, cancelled or failed), and
the manager under threads, cancellation, close(), bad input and a pool that fits one request.
"""

from __future__ import annotations

import math
import random
import threading
import time

import pytest

from common.requests import SamplingParams
from common.tokenizer import encode
from conftest import stage_module

# Loaded by name: no file of a stage may `import stages...` (tests/test_diff_discipline.py).
_stage = stage_module("s04_online_scheduler")
InferenceEngine, OnlineScheduler, OutOfKVBlocks, SchedulerManager = (
    _stage.InferenceEngine, _stage.OnlineScheduler, _stage.OutOfKVBlocks, _stage.SchedulerManager)

# A worker thread that dies (or races close()) must fail the test, not just print a warning.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _assert_pool_empty(engine: InferenceEngine) -> None:
    alloc = engine.pool.allocator
    assert (alloc.num_free, alloc.reserved) == (alloc.num_blocks, 0)
    assert alloc.ref_counts == [0] * alloc.num_blocks


def _assert_accounting(sched: OnlineScheduler) -> None:
    """Blocks in use and bookings are exactly those of the unfinished sessions."""
    alloc = sched.engine.pool.allocator
    live = [sched.session(r) for r in sched.request_ids() if not sched.is_finished(r)]
    assert alloc.num_blocks - alloc.num_free == sum(len(s.block_table) for s in live)
    assert alloc.reserved == sum(s.reserved for s in live)


def _gate_step(mgr: SchedulerManager, at_call: int, release) -> threading.Event:
    """Make the worker's `at_call`-th decode wait (mid-step) until release() is true; returns 'it is there'."""
    reached, decode, calls = threading.Event(), mgr.engine.decode_step_sessions, [0]

    def gated(sessions):
        calls[0] += 1
        if calls[0] == at_call:
            reached.set()
            deadline = time.monotonic() + 20
            while not release() and time.monotonic() < deadline:
                time.sleep(0.005)
        return decode(sessions)

    mgr.engine.decode_step_sessions = gated
    return reached


def _stream(handle, interval: int):
    """Read a handle's stream (never waiting forever) and check it against its final Completion."""
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.extend(handle), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "the stream never ended"
    comp = handle.result(timeout=1)
    assert "".join(c.text for c in chunks) == comp.text
    assert [t for c in chunks for t in c.token_ids] == comp.token_ids
    assert all(len(c.token_ids) == interval for c in chunks[:-1])
    assert len(chunks) <= math.ceil(len(comp.token_ids) / interval) + 1
    return chunks, comp


def test_late_joiners_and_very_different_lengths_match_transformers(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=4)
    sched = OnlineScheduler(engine, max_batch_size=3)
    prompts = _prompts([5, 40, 2, 17, 9, 1, 25], seed=1)
    max_new = [24, 3, 30, 1, 12, 2, 8]
    streams: dict[int, list[int]] = {}
    finished: list[int] = []

    def add(i: int) -> None:
        rid = sched.add_request(prompt_token_ids=prompts[i], max_new_tokens=max_new[i])
        assert rid not in streams
        streams[rid] = [sched.session(rid).generated[0]]  # the prefill already produced the first token
        assert streams[rid] == hf_greedy(prompts[i], max_new[i])[:1]

    def step(n: int = 1) -> None:
        for _ in range(n):
            out = sched.step()
            assert 0 < len(out) <= 3
            for rid, tok in out.items():
                streams[rid].append(tok)
            _assert_accounting(sched)
            for rid in sched.pop_finished_ids():
                assert sched.is_finished(rid) and sched.session(rid).block_table == []
                finished.append(rid)

    add(0), add(1), step(3), add(2), add(3), step(), add(4), step(2), add(5), add(6)
    while sched.has_unfinished():
        step()
    finished += sched.pop_finished_ids()
    assert sorted(finished) == sorted(streams) and sched.pop_finished_ids() == []  # each id reported once
    for rid, p, n in zip(sorted(streams), prompts, max_new):
        comp = sched.pop_completion(rid)
        assert comp.token_ids == streams[rid] == hf_greedy(p, n)
    assert sched.request_ids() == []
    _assert_pool_empty(engine)


def test_round_robin_when_more_sessions_than_slots(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=8)
    sched = OnlineScheduler(engine, max_batch_size=2)
    prompts = _prompts([3, 9, 1, 14, 6], seed=2)
    rids = [sched.add_request(prompt_token_ids=p, max_new_tokens=10, stop_on_eos=False) for p in prompts]
    counts = dict.fromkeys(rids, 1)
    for i in range(12):  # nobody can finish yet: 24 tokens over 5 sessions
        out = sched.step()
        assert len(out) == 2
        for rid in out:
            counts[rid] += 1
        assert max(counts.values()) - min(counts.values()) <= 1, counts  # every session progresses
    while sched.has_unfinished():
        assert len(sched.step()) <= 2
    for rid, p in zip(rids, prompts):
        assert sched.pop_completion(rid).token_ids == hf_greedy(p, 10)
    _assert_pool_empty(engine)


def test_finished_session_frees_its_blocks_in_the_same_step(tiny):
    engine = InferenceEngine(tiny, block_size=4)
    alloc = engine.pool.allocator
    sched = OnlineScheduler(engine, max_batch_size=4)
    long_p, short_p = _prompts([3, 8], seed=3)
    long = sched.add_request(prompt_token_ids=long_p, max_new_tokens=20, stop_on_eos=False)
    short = sched.add_request(prompt_token_ids=short_p, max_new_tokens=3, stop_on_eos=False)
    sched.step()  # short caches 9 tokens (3 blocks), long 4 (1 block)
    assert alloc.num_blocks - alloc.num_free == 4
    sched.step()  # short emits its 3rd token and finishes; long caches its 5th token (2nd block)
    assert sched.is_finished(short) and not sched.is_finished(long)
    assert alloc.num_blocks - alloc.num_free == 2 == len(sched.session(long).block_table)
    assert alloc.reserved == sched.session(long).reserved
    assert sched.pop_finished_ids() == [short] and sched.pop_finished_ids() == []
    text = tiny.tokenizer.decode(sched.session(short).generated, skip_special_tokens=True)
    assert sched.get_response(short) == text == sched.pop_response(short)
    assert short not in sched
    sched.discard_request(long)  # unfinished: its blocks and bookings go back too
    assert long not in sched and not sched.has_unfinished()
    _assert_pool_empty(engine)
    done = sched.add_request(prompt_token_ids=short_p, max_new_tokens=1)  # finished by its prefill
    assert sched.is_finished(done) and sched.step() == {}
    sched.discard_request(done)
    assert sched.pop_finished_ids() == []  # a discarded request is never reported


def test_add_request_errors_leave_nothing_behind(tiny):
    engine = InferenceEngine(tiny, block_size=4, num_kv_blocks=5)
    sched = OnlineScheduler(engine, max_batch_size=4)
    a, b = _prompts([9, 10], seed=4)
    first = sched.add_request(prompt_token_ids=a, max_new_tokens=5)  # books ceil(14/4) = 4 of 5 blocks
    state = (engine.pool.allocator.num_free, engine.pool.allocator.reserved, sched.request_ids())
    with pytest.raises(OutOfKVBlocks):
        sched.add_request(prompt_token_ids=b, max_new_tokens=5)
    with pytest.raises(ValueError, match="top_p"):
        sched.add_request("hi", top_p=2.0)
    with pytest.raises(ValueError, match="^prompt: "):
        sched.add_request(prompt_token_ids=b * 3, max_new_tokens=1)  # can never fit in 5 blocks
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(prompt_token_ids=a, max_new_tokens=1, request_id=first)  # would orphan `first`
    assert (engine.pool.allocator.num_free, engine.pool.allocator.reserved, sched.request_ids()) == state
    while sched.has_unfinished():
        sched.step()
    sched.pop_completion(first)
    second = sched.add_request(prompt_token_ids=b, max_new_tokens=5)  # fits now
    assert second != first


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_concatenates_to_the_final_text(tiny, hf_greedy, interval):
    prompts = ["The capital of France is", "你好，世界！今天天气怎么样？", "日本語のテキスト 😀🎉", "café naïve"]
    engine = InferenceEngine(tiny, block_size=8)
    with SchedulerManager(engine, max_batch_size=4, stream_interval=interval) as mgr:
        handles = [mgr.add_request(p, max_new_tokens=10 + i) for i, p in enumerate(prompts)]
        for i, h in enumerate(handles):
            chunks, comp = _stream(h, interval)
            assert comp.token_ids == hf_greedy(encode(tiny.tokenizer, prompts[i]), 10 + i)
        _assert_pool_empty(engine)


class ScriptedModel:
    """Runs the real model (K/V are written as usual) but makes `script` the greedy continuation."""

    def __init__(self, model, prompt_len: int, script: list[int]) -> None:
        self.model, self.prompt_len, self.script = model, prompt_len, script

    def __call__(self, input_ids, positions, attention, logits_indices=None):
        logits = self.model(input_ids, positions, attention, logits_indices=logits_indices)  # [B, V]
        forced = logits.new_full(logits.shape, -1e9)
        for b in range(logits.shape[0]):
            pos = int(positions[b, logits_indices[b]])
            forced[b, self.script[pos - self.prompt_len + 1]] = 0.0
        return forced


@pytest.mark.parametrize("interval", [1, 3])
def test_multibyte_characters_split_across_tokens_stream_whole(tiny, interval):
    text = "你好, 世界! 😀 naïve café 日本語 🎉"
    script = encode(tiny.tokenizer, text)  # many of these tokens are single bytes of a UTF-8 character
    prompt = _prompts([7], seed=5)[0]
    engine = InferenceEngine(tiny, block_size=4)
    engine.model = ScriptedModel(engine.model, len(prompt), script)
    with SchedulerManager(engine, max_batch_size=2, stream_interval=interval) as mgr:
        handles = [mgr.add_request(prompt_token_ids=prompt, max_new_tokens=len(script)) for _ in range(2)]
        for h in handles:
            chunks, comp = _stream(h, interval)
            assert comp.token_ids == script and comp.text == text
            assert not any("\ufffd" in c.text for c in chunks)  # never half a character
            if interval == 1:
                assert any(c.token_ids and not c.text for c in chunks)  # bytes were held back
    _assert_pool_empty(engine)


def test_many_threads_submitting_at_once_all_get_full_results(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=8)
    token_prompts = _prompts([1, 5, 9, 14, 22, 30, 3, 40], seed=6)
    text_prompts = ["Hello", "你好，世界", "def f(x):", "Once upon a time"]
    barrier, results, errors = threading.Barrier(8), {}, []

    def client(t: int) -> None:
        try:
            barrier.wait(timeout=30)
            hs = [(i, mgr.add_request(prompt_token_ids=token_prompts[(t + i) % 8], max_new_tokens=3 * i + 1))
                  for i in range(3)] + [(3, mgr.add_request(text_prompts[t % 4], max_new_tokens=5))]
            results.update({(t, i): (h.request_id, h.result(timeout=60)) for i, h in hs})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with SchedulerManager(engine, max_batch_size=4, tokenize_workers=2) as mgr:
        threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors and len(results) == 32
        assert len({rid for rid, _ in results.values()}) == 32
        for (t, i), (_, comp) in results.items():
            n = 5 if i == 3 else 3 * i + 1
            assert comp.token_ids == hf_greedy(comp.prompt_token_ids, n), (t, i)
            assert {"submitted", "tokenized", "scheduled", "first_token", "finished"} <= set(comp.timings)
        _assert_pool_empty(engine)


def test_cancel_ends_one_request_and_the_others_complete(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=4)
    prompts = _prompts([4, 11, 6, 8], seed=7)
    release = threading.Event()
    with SchedulerManager(engine, max_batch_size=4) as mgr:
        reached = _gate_step(mgr, 3, release.is_set)
        victim, *others = [mgr.add_request(prompt_token_ids=p, max_new_tokens=40, stop_on_eos=False) for p in prompts[:3]]
        assert reached.wait(30)  # the worker is inside its 3rd decode step
        queued = mgr.add_request(prompt_token_ids=prompts[3], max_new_tokens=5)
        mgr.cancel(victim.request_id)
        mgr.cancel(queued.request_id)  # cancelled before the worker ever admits it
        mgr.cancel(10_000)  # unknown ids are ignored
        release.set()
        comp = victim.result(timeout=30)
        assert comp.finish_reason == "cancelled" and 1 <= len(comp.token_ids) < 40
        assert comp.token_ids == hf_greedy(prompts[0], 40)[: len(comp.token_ids)]
        assert queued.result(timeout=30).finish_reason == "cancelled"
        for h, p in zip(others, prompts[1:]):
            c = h.result(timeout=30)
            assert c.finish_reason == "length" and c.token_ids == hf_greedy(p, 40)
        _assert_pool_empty(engine)


@pytest.mark.parametrize("stuck", [False, True])
def test_close_with_requests_in_flight_ends_every_request(tiny, hf_greedy, stuck):
    engine = InferenceEngine(tiny, block_size=8)
    prompts = _prompts([3, 5, 7, 9, 11, 13], seed=8)
    mgr, unstick = SchedulerManager(engine, max_batch_size=2), threading.Event()
    # Hold the worker in its 2nd step until close() has begun — or, when `stuck`, past close()'s join timeout.
    reached = _gate_step(mgr, 2, unstick.is_set if stuck else lambda: not mgr._running)
    handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=100, stop_on_eos=False) for p in prompts]
    assert reached.wait(30)
    # close() runs on a thread of its own, so that one that never returns (say, it waits for the
    # stuck worker past its own timeout) fails the test instead of hanging it. `returned` fires
    # only once close() is done: the 60 s wait is hang detection, not a speed claim.
    returned, raised = threading.Event(), []

    def close() -> None:
        try:
            mgr.close(timeout=0.2 if stuck else 10.0)
        except BaseException as exc:  # re-raised below, on the test's thread
            raised.append(exc)
        finally:
            returned.set()

    threading.Thread(target=close, daemon=True, name="test-close").start()
    assert returned.wait(60), "close() never returned"
    if raised:
        raise raised[0]
    # Stuck: close() gave up on its join and returned while the worker was still held mid-step (it
    # is let go only below, or by the gate's own 20 s fallback): it did not wait for the worker.
    assert not stuck or mgr._worker.is_alive()
    comps = [h.result(timeout=30) for h in handles]  # none hangs
    assert all(c.finish_reason == "cancelled" for c in comps)
    assert stuck or any(c.token_ids for c in comps)  # some were mid-decode, with their tokens so far
    for p, c in zip(prompts, comps):
        assert not c.token_ids or c.token_ids == hf_greedy(p, len(c.token_ids))
    unstick.set()
    mgr._worker.join(30)  # a stuck worker finishes its step, then gives the blocks back itself
    _assert_pool_empty(engine)
    with pytest.raises(RuntimeError, match="closed"):
        mgr.add_request("too late")


def test_failed_decode_step_fails_the_running_requests_only(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=4)
    decode, calls = engine.decode_step_sessions, [0]

    def flaky(sessions):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("device fell over")
        return decode(sessions)

    engine.decode_step_sessions = flaky
    a, b = _prompts([6, 4], seed=11)
    with SchedulerManager(engine, max_batch_size=2) as mgr:
        with pytest.raises(RuntimeError, match="fell over"):
            mgr.add_request(prompt_token_ids=a, max_new_tokens=8).result(timeout=30)
        _assert_pool_empty(engine)
        # The worker survived: later requests are served.
        assert mgr.add_request(prompt_token_ids=b, max_new_tokens=5).result(timeout=30).token_ids == hf_greedy(b, 5)
    _assert_pool_empty(engine)


def test_bad_input_fails_only_that_request(tiny, hf_greedy):
    engine = InferenceEngine(tiny, block_size=4, num_kv_blocks=16)
    prompts = _prompts([5, 12, 3], seed=9)
    with SchedulerManager(engine, max_batch_size=4) as mgr:
        good, bad = [], []  # (the field the error must start with, its handle)
        good.append(mgr.add_request(prompt_token_ids=prompts[0], max_new_tokens=6))
        bad.append(("prompt", mgr.add_request("")))
        bad.append(("max_new_tokens", mgr.add_request("hi", max_new_tokens=0)))
        good.append(mgr.add_request(prompt_token_ids=prompts[1], max_new_tokens=6))
        bad.append(("top_p", mgr.add_request("hi", params=SamplingParams(top_p=2.0))))
        bad.append(("foo", mgr.add_request("hi", foo=1)))  # unknown sampling keyword
        bad.append(("prompt_token_ids", mgr.add_request(prompt_token_ids=[5, len(tiny.tokenizer) + 7])))
        bad.append(("prompt", mgr.add_request(prompt_token_ids=prompts[1] * 6, max_new_tokens=2)))  # 72 + 1 > 64 slots
        bad.append(("max_new_tokens", mgr.add_request(prompt_token_ids=prompts[0], max_new_tokens=60)))  # 5 + 60 > 64
        good.append(mgr.add_request(prompt_token_ids=prompts[2], max_new_tokens=6))
        for field, h in bad:
            with pytest.raises(ValueError, match=rf"^{field}\b"):
                h.result(timeout=30)
        for h, p in zip(good, prompts):
            assert h.result(timeout=30).token_ids == hf_greedy(p, 6)
        _assert_pool_empty(engine)


def test_pool_for_one_request_at_a_time_makes_the_others_wait(tiny, hf_greedy):
    # Worst cases (block_size 4): 4, 4, 5, 3 and 4 blocks of a 5-block pool: never two at once.
    engine = InferenceEngine(tiny, block_size=4, num_kv_blocks=5)
    batch_sizes, release = [], threading.Event()
    decode = engine.decode_step_sessions
    engine.decode_step_sessions = lambda sessions: batch_sizes.append(len(sessions)) or decode(sessions)
    prompts = _prompts([9, 10, 12, 7, 9], seed=10)
    with SchedulerManager(engine, max_batch_size=4, record_token_timestamps=True) as mgr:
        reached = _gate_step(mgr, 2, release.is_set)
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=5, stop_on_eos=False) for p in prompts]
        assert reached.wait(30)  # the first request is decoding; the others wait for its blocks
        mgr.cancel(handles[-1].request_id)  # a request waiting for KV can be cancelled too
        release.set()
        cancelled = handles[-1].result(timeout=30)
        assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []
        comps = [h.result(timeout=60) for h in handles[:-1]]
        for p, c in zip(prompts, comps):
            assert c.token_ids == hf_greedy(p, 5) and c.finish_reason == "length"
        assert batch_sizes == [1] * 16  # 4 requests x 4 decode steps, one request at a time
        for before, after in zip(comps, comps[1:]):  # in submission order, one after the other
            assert after.token_timestamps[0] > before.token_timestamps[-1]
        _assert_pool_empty(engine)
