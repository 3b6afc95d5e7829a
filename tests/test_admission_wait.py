"""The idle worker's admission wait (`max_queue_delay_ms`, `queue_quiet_ms`), in every streaming stage.

Requests added a few milliseconds apart to an idle manager: with the wait on they are admitted in
ONE round (one batched prefill, no decode step between their admissions); with it off (the
default) the first is admitted alone, as before. A lone request is never held past the maximum.
Every wait is bounded; nothing here is a speed claim.
"""
from __future__ import annotations

import inspect
import time

import pytest

from common import stages as registry
from conftest import streaming_packages

STREAMING = streaming_packages()
PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time"]


def _manager(package: str, tiny, **knobs):
    stage = registry.load_stage(package)
    return stage.SchedulerManager(stage.InferenceEngine(tiny, max_batch_size=8), max_batch_size=8, **knobs)


def _record(manager) -> list[str]:
    """Log the worker's admissions ("admit", one per request) and decode steps ("step"), in order."""
    events: list[str] = []
    sched = manager.scheduler
    if hasattr(sched, "add_requests"):  # stage 06+: a burst is one call, one batched prefill
        batched = sched.add_requests
        sched.add_requests = lambda reqs: (events.extend(["admit"] * len(reqs)), batched(reqs))[1]
    single = sched.add_request  # stages 04-05 admit one request at a time
    sched.add_request = lambda *a, **k: (events.append("admit"), single(*a, **k))[1]
    step = sched.step
    sched.step = lambda: (events.append("step"), step())[1]
    return events


def _record_wakes(manager) -> list[int]:
    """Log the pending queue's length at every wake of the worker."""
    wakes: list[int] = []
    real_set = manager._wakeup.set
    manager._wakeup.set = lambda: (wakes.append(manager._pending.qsize()), real_set())[1]
    return wakes


def _rounds(events: list[str]) -> int:
    """Admission rounds: runs of admissions with no decode step between them."""
    return sum(1 for i, e in enumerate(events) if e == "admit" and (i == 0 or events[i - 1] == "step"))


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _burst(manager, gap_s: float) -> list:
    handles = []
    for prompt in PROMPTS:
        handles.append(manager.add_request(prompt, max_new_tokens=4, temperature=0.0))
        time.sleep(gap_s)
    return handles


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_wait_admits_a_spread_burst_in_one_round(package, tiny):
    # A quiet window far longer than the gaps, so a slow machine cannot split the burst.
    with _manager(package, tiny, max_queue_delay_ms=10_000, queue_quiet_ms=1_000) as manager:
        events = _record(manager)
        handles = _burst(manager, gap_s=0.005)
        for h in handles:
            assert len(h.result(timeout=60).token_ids) == 4
    assert events.count("admit") == len(PROMPTS)
    assert _rounds(events) == 1, events


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_without_the_wait_the_first_arrival_is_admitted_alone(package, tiny):
    with _manager(package, tiny) as manager:  # the default: off
        events = _record(manager)
        first = manager.add_request(PROMPTS[0], max_new_tokens=4, temperature=0.0)
        _wait_for(lambda: "step" in events)  # admitted and decoding before anyone else arrives
        rest = [manager.add_request(p, max_new_tokens=4, temperature=0.0) for p in PROMPTS[1:]]
        for h in [first, *rest]:
            assert len(h.result(timeout=60).token_ids) == 4
    assert events[:2] == ["admit", "step"]
    assert _rounds(events) >= 2, events


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_lone_request_waits_no_longer_than_the_maximum(package, tiny):
    # The quiet window alone would hold it for a minute; the maximum (0.2 s) lets it in.
    with _manager(package, tiny, max_queue_delay_ms=200, queue_quiet_ms=60_000) as manager:
        handle = manager.add_request(PROMPTS[1], max_new_tokens=4, temperature=0.0)
        assert len(handle.result(timeout=30).token_ids) == 4


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
@pytest.mark.parametrize("field", ["max_queue_delay_ms", "queue_quiet_ms"])
@pytest.mark.parametrize("value", [-1, float("inf")])  # inf: Event.wait would raise OverflowError in the worker
def test_a_negative_or_endless_wait_is_refused_naming_the_field(package, field, value, tiny):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        _manager(package, tiny, **{field: value})


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_close_ends_a_burst_wait_at_once(package, tiny):
    """close() while the idle worker holds admission for a burst (windows of minutes): the worker
    leaves the wait and exits within close()'s join, and the request ends, not left hanging."""
    manager = _manager(package, tiny, max_queue_delay_ms=600_000, queue_quiet_ms=300_000)
    handle = manager.add_request(PROMPTS[0], max_new_tokens=4, temperature=0.0)
    _wait_for(lambda: manager._collecting)
    manager.close()
    assert not manager._worker.is_alive()
    assert handle.result(timeout=10).finish_reason in ("cancelled", "length")


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_arrivals_wake_the_waiting_worker_only_when_the_batch_is_full(package, tiny):
    # A wake per arrival would take the GIL from the thread submitting the rest of the burst.
    # The windows are longer than the result timeout: only the full batch's wake admits in time.
    with _manager(package, tiny, max_queue_delay_ms=600_000, queue_quiet_ms=300_000) as manager:  # batch of 8
        events = _record(manager)
        wakes = _record_wakes(manager)
        handles = [manager.add_request(PROMPTS[0], max_new_tokens=4, temperature=0.0)]
        _wait_for(lambda: manager._collecting)  # the idle worker now holds admission for the burst
        handles += [manager.add_request(f"{PROMPTS[1]} {i}", max_new_tokens=4, temperature=0.0) for i in range(7)]
        for h in handles:
            assert len(h.result(timeout=60).token_ids) == 4
        assert wakes == [1, 8], wakes  # the first arrival (the worker was idle) and the full batch
    assert _rounds(events) == 1, events


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
@pytest.mark.parametrize("knob", ["max_queue_delay_ms", "queue_quiet_ms"])
@pytest.mark.parametrize("value", ["x", None, float("nan"), True])
def test_a_bad_wait_is_refused_by_name(package, knob, value, tiny) -> None:
    with pytest.raises(ValueError, match=f"^{knob} must be a finite number >= 0"):
        _manager(package, tiny, **{knob: value})


@pytest.mark.parametrize("package", [p for p in STREAMING if "prefill_max_batch_size"
                                     in inspect.signature(registry.load_stage(p).SchedulerManager).parameters],
                         ids=registry.short_name)
def test_a_burst_is_collected_up_to_what_one_admission_takes(package, tiny):
    """From stage 07 one admission takes prefill_max_batch_size requests, not max_batch_size: the
    burst wait holds out for that many too (it stopped at the decode batch, 2 here, and the rest of
    the burst came in later rounds). From stage 13 at most max_batch_size sessions are admitted at
    once, so there it holds out for 2. The windows are longer than the result timeout."""
    stage = registry.load_stage(package)
    full = 2 if registry.stage_number(package) >= 13 else 6
    engine = stage.InferenceEngine(tiny, max_batch_size=2, kv_cache_max_concurrency=8)
    with stage.SchedulerManager(engine, max_batch_size=2, prefill_max_batch_size=6, max_queue_delay_ms=600_000,
                                queue_quiet_ms=300_000) as manager:
        events = _record(manager)
        wakes = _record_wakes(manager)
        handles = [manager.add_request(PROMPTS[0], max_new_tokens=4, temperature=0.0)]
        _wait_for(lambda: manager._collecting)
        for i in range(5):
            handles.append(manager.add_request(f"{PROMPTS[1]} {i}", max_new_tokens=4, temperature=0.0))
            if i + 2 == full:  # the wake that ends the wait: what follows arrives at a busy worker
                _wait_for(lambda: "admit" in events)
        for h in handles:
            assert len(h.result(timeout=60).token_ids) == 4
    assert wakes[:2] == [1, full], wakes
    if full == 6:
        assert events.count("admit") == 6 and _rounds(events) == 1, events
