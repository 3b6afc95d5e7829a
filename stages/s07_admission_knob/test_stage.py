"""Stage 07's own idea: `prefill_max_batch_size` — how many pending requests one worker iteration admits.

Cross-stage parity is in tests/test_parity.py. Here: the post's two tests (non-positive knobs
fail fast; the knob is decoupled from the decode batch size), None keeping the old behaviour
(= max_batch_size), and the worker admitting up to `prefill_max_batch_size` requests per
`add_requests` call while every decode step still runs at most `max_batch_size` sessions —
with the tokens transformers gives.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from stages.s07_admission_knob import InferenceEngine, SchedulerManager


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tiny):
    return InferenceEngine(tiny, max_batch_size=2, block_size=4, kv_cache_max_concurrency=12,
                           prefix_cache_max_entries=0)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# ---- the post's two tests ------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1])
def test_scheduler_manager_prefill_max_batch_size_validates_positive(engine, bad):
    with pytest.raises(ValueError, match="prefill_max_batch_size must be positive"):
        SchedulerManager(engine, max_batch_size=2, prefill_max_batch_size=bad)
    with pytest.raises(ValueError, match="^max_batch_size must be positive"):
        SchedulerManager(engine, max_batch_size=bad, prefill_max_batch_size=8)


def test_scheduler_manager_prefill_max_batch_size_decouples_from_decode(engine, hf_greedy):
    # A burst of 7 with the knob at 5 and the decode batch at 2: the worker admits 5, then the
    # other 2, and no decode step runs more than 2 sessions. (Admission capped by the decode
    # batch would give [2, 2, 2, 1]; the decode batch widened to the knob, steps of 5.)
    admits, steps = _burst(engine, hf_greedy, n=7, max_batch_size=2, prefill_max_batch_size=5)
    assert admits == [5, 2]
    assert max(steps) == 2


def test_none_keeps_the_old_behaviour(engine, hf_greedy):
    # The knob left out, or None: one worker iteration admits max_batch_size requests, as in stage 06.
    assert _burst(engine, hf_greedy, n=7, max_batch_size=3)[0] == [3, 3, 1]
    assert _burst(engine, hf_greedy, n=7, max_batch_size=3, prefill_max_batch_size=None)[0] == [3, 3, 1]


# ---- the knob at work ----------------------------------------------------------------------

def _burst(engine, hf_greedy, n: int = 8, **knobs: int | None) -> tuple[list[int], list[int]]:
    """Hold the worker, queue n requests, let it go; returns (add_requests sizes, decode step sizes).
    `knobs` go to the SchedulerManager as given (a knob left out takes its default)."""
    with SchedulerManager(engine, **knobs) as mgr:
        admits: list[int] = []
        steps: list[int] = []
        add_requests, step = mgr.scheduler.add_requests, mgr.scheduler.step
        mgr.scheduler.add_requests = lambda reqs: admits.append(len(reqs)) or add_requests(reqs)

        def counted_step() -> dict[int, int]:
            out = step()
            steps.append(len(out))
            return out

        mgr.scheduler.step = counted_step
        go, parked = threading.Event(), threading.Event()
        admit = mgr._admit_pending

        def gated() -> None:  # the whole burst is pending before the worker admits anything
            parked.set()
            go.wait(10)
            admit()

        mgr._admit_pending = gated
        assert parked.wait(10)
        prompts = [_ids(2 + i, seed=i) for i in range(n)]
        handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=4, stop_on_eos=False) for p in prompts]
        go.set()
        for p, h in zip(prompts, handles):
            assert h.result(timeout=60).token_ids == hf_greedy(p, 4)
    return admits, steps


def test_worker_admits_up_to_prefill_max_batch_size_and_decodes_max_batch_size(engine, hf_greedy):
    admits, steps = _burst(engine, hf_greedy, max_batch_size=2, prefill_max_batch_size=8)
    assert admits == [8]  # the whole burst in one add_requests call (one batched prefill)
    assert max(steps) == 2 and steps.count(2) >= 1  # yet a decode step never runs more than 2 sessions
    assert sum(steps) == 8 * 3  # 3 decode tokens per request after the prefill's first one
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0


def test_without_the_knob_admission_is_capped_by_the_decode_batch(engine, hf_greedy):
    admits, steps = _burst(engine, hf_greedy, max_batch_size=2, prefill_max_batch_size=None)
    assert admits == [2, 2, 2, 2]  # stage 06's behaviour: the burst waits four worker iterations
    assert max(steps) == 2


def test_knob_smaller_than_the_decode_batch(engine, hf_greedy):
    admits, steps = _burst(engine, hf_greedy, max_batch_size=8, prefill_max_batch_size=3)
    assert admits == [3, 3, 2]
    assert max(steps) <= 8 and sum(steps) == 8 * 3
