"""Stage 09's own idea: the worker takes its lock once per decode step, not once per token.

Cross-stage parity is in tests/test_parity.py. Here: a counting lock proves that the lock
acquisitions made inside one `_run_decode_once` stay at 1 whatever the batch size — while
stage 08, measured the same way, takes one per token (and one per finished request); streaming
is still exact (the chunks add up to the final text and to transformers' tokens, with
stream_interval 1 and 8); finished requests are delivered; and close() ends in-flight requests.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch

from common.requests import SamplingParams
from stages import s08_token_id_cache_keys as s08  # the contrast: the same measurement one stage earlier
from stages import s09_batched_worker_lookups as s09


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountingLock:
    """A real threading.Lock that counts acquisitions per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_thread: Counter[int] = Counter()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self.by_thread[threading.get_ident()] += 1  # counted while held: no race
        return ok

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "CountingLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _hold_admission(mgr) -> threading.Event:
    """Park the worker before its next admission; set the returned event to let it go."""
    go, parked = threading.Event(), threading.Event()
    admit = mgr._admit_pending

    def gated() -> None:
        parked.set()
        go.wait(10)
        admit()

    mgr._admit_pending = gated
    assert parked.wait(10)
    return go


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _locks_per_decode_step(stage, tiny, hf_greedy, batch: int) -> list[tuple[int, int, int]]:
    """(sessions decoded, requests finished, lock acquisitions) for every _run_decode_once call."""
    engine = stage.InferenceEngine(tiny, max_batch_size=batch, prefix_cache_max_entries=0)
    records: list[tuple[int, int, int]] = []
    with stage.SchedulerManager(engine, max_batch_size=batch) as mgr:
        lock = mgr._lock = CountingLock()  # before any request exists
        go = _hold_admission(mgr)  # the whole batch is admitted at once: every step decodes `batch`
        sched, step, run_decode_once = mgr.scheduler, mgr.scheduler.step, mgr._run_decode_once
        last: dict[str, int] = {}

        def counted_step() -> dict[int, int]:
            out = step()
            last["decoded"], last["finished"] = len(out), sum(sched.is_finished(r) for r in out)
            return out

        def counted_run_decode_once() -> None:
            me = threading.get_ident()
            before = lock.by_thread[me]
            run_decode_once()
            records.append((last["decoded"], last["finished"], lock.by_thread[me] - before))

        sched.step, mgr._run_decode_once = counted_step, counted_run_decode_once
        prompts = [_ids(3 + i, seed=i) for i in range(batch)]
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=5, stop_on_eos=False) for p in prompts]
        go.set()
        for p, h in zip(prompts, handles):
            assert h.result(timeout=60).token_ids == hf_greedy(p, 5)  # every finished request delivered
    assert [(d, f) for d, f, _ in records] == [(batch, 0)] * 3 + [(batch, batch)]  # 4 full decode steps
    return records


@pytest.mark.parametrize("batch", [2, 8])
def test_one_lock_acquisition_per_decode_step_whatever_the_batch(tiny, hf_greedy, batch):
    records = _locks_per_decode_step(s09, tiny, hf_greedy, batch)
    assert [locks for _, _, locks in records] == [1, 1, 1, 1]


def test_stage_08_took_one_per_token_so_it_grew_with_the_batch(tiny, hf_greedy):
    per_batch = {b: _locks_per_decode_step(s08, tiny, hf_greedy, b) for b in (2, 8)}
    for b, records in per_batch.items():  # one per token pushed, plus one per request finished
        assert [locks for _, _, locks in records] == [b, b, b, 2 * b]
    assert per_batch[8][0][2] == 4 * per_batch[2][0][2]


@pytest.mark.parametrize("interval", [1, 8])
def test_streaming_chunks_add_up_to_the_completion(tiny, hf_greedy, interval):
    engine = s09.InferenceEngine(tiny, max_batch_size=4, block_size=4)
    prompts = ["Tell me a story about a cat", "Hello", "def fibonacci(n):", "你好，世界！", "Tell me a story about a cat"]
    max_new = [20, 9, 1, 16, 13]
    with s09.SchedulerManager(engine, max_batch_size=3, stream_interval=interval) as mgr:
        handles = [mgr.add_request(p, max_new_tokens=n) for p, n in zip(prompts, max_new)]
        for h, n in zip(handles, max_new):
            chunks = list(h)
            done = h.result(timeout=60)
            assert "".join(c.text for c in chunks) == done.text
            assert [t for c in chunks for t in c.token_ids] == done.token_ids == hf_greedy(done.prompt_token_ids, n)
            assert all(len(c.token_ids) == interval for c in chunks[:-1]) and len(chunks[-1].token_ids) <= interval
    engine.prefix_cache.clear()
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0


def test_close_ends_in_flight_requests(tiny):
    engine = s09.InferenceEngine(tiny, max_batch_size=2, block_size=4)
    mgr = s09.SchedulerManager(engine, max_batch_size=2)
    release, parked = threading.Event(), threading.Event()
    step = mgr.scheduler.step

    def held_step() -> dict[int, int]:  # the 2nd decode step waits until close() has begun
        if parked.is_set():
            release.wait(10)
        out = step()
        parked.set()
        return out

    mgr.scheduler.step = held_step
    params = SamplingParams(max_new_tokens=100, stop_on_eos=False)
    handles = [mgr.add_request(prompt_token_ids=_ids(4, seed=i), params=params) for i in range(5)]
    assert parked.wait(30)
    closer = threading.Thread(target=mgr.close)
    closer.start()
    deadline = time.monotonic() + 10
    while mgr._running and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    results = [h.result(timeout=10) for h in handles]  # none hangs
    assert all(r.finish_reason == "cancelled" and len(r.token_ids) < 100 for r in results)
    assert any(r.token_ids for r in results)  # the running ones end with their tokens so far
    with pytest.raises(RuntimeError, match="closed"):
        mgr.add_request("too late")
    engine.prefix_cache.clear()
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0
