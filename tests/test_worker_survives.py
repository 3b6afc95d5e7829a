"""A bug outside the model's step must not end a SchedulerManager's worker, in every streaming stage.

Why: the worker thread is the only thing that ever ends a request. A step that fails (the
device fell over) was always caught: its requests end with the error. But an exception from
anywhere else in the worker's loop (detokenizing a token, delivering it, admitting a burst)
ended the thread, and from then on every request in flight, and every one submitted after,
waited forever. Now the requests the worker holds end with that error, and the worker serves
the next ones. A request whose end (its Completion) cannot be built gets that error itself.
"""
from __future__ import annotations

import importlib

import pytest

from common import stages as registry
from common.tokenizer import IncrementalDetokenizer
from conftest import streaming_packages

STREAMING = streaming_packages()


class FailsOnce(IncrementalDetokenizer):
    """The first token any request's detokenizer sees raises; every later one works."""

    failed = False

    def add(self, token_id: int) -> str:
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("detokenizer fell over")
        return super().add(token_id)


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_bug_outside_the_step_ends_its_requests_with_it_and_the_worker_goes_on(package, tiny, monkeypatch):
    stage = registry.load_stage(package)
    monkeypatch.setattr(importlib.import_module(f"{package}.server"), "IncrementalDetokenizer", FailsOnce)
    monkeypatch.setattr(FailsOnce, "failed", False)
    engine = stage.InferenceEngine(tiny, max_batch_size=4)
    with stage.SchedulerManager(engine, max_batch_size=4) as manager:
        first = manager.add_request("Hello", max_new_tokens=6, temperature=0.0)
        with pytest.raises(RuntimeError, match="detokenizer fell over"):
            first.result(timeout=30)
        assert manager._worker.is_alive()
        later = manager.add_request("The capital of France is", max_new_tokens=6, temperature=0.0)
        assert len(later.result(timeout=30).token_ids) == 6
        assert not manager.scheduler.has_unfinished()  # the failed request left the scheduler (its blocks too)


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_request_whose_completion_fails_ends_with_the_error(package, tiny):
    """The end of a request is built after its queue has left the manager's books: a failure
    there must still reach that request (it hung), and only that one."""
    stage = registry.load_stage(package)
    engine = stage.InferenceEngine(tiny, max_batch_size=4)
    real, calls = engine.completion, []

    def fails_once(session):
        calls.append(session)
        if len(calls) == 1:
            raise RuntimeError("completion fell over")
        return real(session)

    engine.completion = fails_once
    with stage.SchedulerManager(engine, max_batch_size=4) as manager:
        with pytest.raises(RuntimeError, match="completion fell over"):
            manager.add_request("Hello", max_new_tokens=4, temperature=0.0).result(timeout=30)
        assert len(manager.add_request("Hi", max_new_tokens=4, temperature=0.0).result(timeout=30).token_ids) == 4
        assert not manager.scheduler.has_unfinished()


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_request_an_idle_pool_refuses_ends_with_an_error_naming_what_it_booked(package, tiny):
    """The engine refuses at once what can never fit (`new_session` names the field), so an idle
    pool refusing a booking should not happen; if it does, nothing will ever free blocks for that
    request. It must end with an error a client can act on (the HTTP layer turns a message that
    starts with a field into that field's 400), not wait forever, and the next request runs. The
    field is what the booking counted: prompt + max_new_tokens up to stage 12, the prompt alone
    from stage 13 on (blocks on demand)."""
    stage = registry.load_stage(package)
    field = "prompt" if registry.stage_number(package) >= 13 else "max_new_tokens"
    engine = stage.InferenceEngine(tiny, max_batch_size=4)
    real, calls = engine.reserve, []

    def refuses_once(session, *args, **kwargs):
        calls.append(session)
        if len(calls) == 1:
            raise stage.OutOfKVBlocks("forced: the pool refuses while idle")
        return real(session, *args, **kwargs)

    engine.reserve = refuses_once
    with stage.SchedulerManager(engine, max_batch_size=4) as manager:
        with pytest.raises(ValueError, match=rf"^{field}: request .* even when it is idle"):
            manager.add_request("Hello", max_new_tokens=4, temperature=0.0).result(timeout=30)
        assert len(manager.add_request("Hi", max_new_tokens=4, temperature=0.0).result(timeout=30).token_ids) == 4
        assert not manager.scheduler.has_unfinished()


class FailsOnThird(IncrementalDetokenizer):
    """The third token seen by any request's detokenizer raises; every other one works."""

    seen = 0

    def add(self, token_id: int) -> str:
        FailsOnThird.seen += 1
        if FailsOnThird.seen == 3:
            raise RuntimeError("detokenizer fell over")
        return super().add(token_id)


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_bug_in_a_step_that_finishes_a_request_still_ends_every_request(package, tiny, monkeypatch):
    """The step that fails to deliver a token also finishes another request: that one has left the
    manager's queues already (stage 09 looks every record up once, up front), and must still end,
    not wait forever. Tokens: each request's first comes from its prefill (1, 2); the step after
    gives A its last and B its second (3: the failure)."""
    stage = registry.load_stage(package)
    monkeypatch.setattr(importlib.import_module(f"{package}.server"), "IncrementalDetokenizer", FailsOnThird)
    monkeypatch.setattr(FailsOnThird, "seen", 0)
    engine = stage.InferenceEngine(tiny, max_batch_size=2)
    with stage.SchedulerManager(engine, max_batch_size=2, max_queue_delay_ms=60_000, queue_quiet_ms=200) as manager:
        a = manager.add_request(prompt_token_ids=[11, 12, 13], max_new_tokens=2, stop_on_eos=False)
        b = manager.add_request(prompt_token_ids=[21, 22, 23], max_new_tokens=6, stop_on_eos=False)
        ends = []
        for handle in (a, b):
            try:
                ends.append(len(handle.result(timeout=30).token_ids))
            except RuntimeError as exc:
                assert "fell over" in str(exc)
                ends.append("failed")
        assert "failed" in ends  # the bug reached someone; and nobody waited for the timeout
        assert manager._worker.is_alive() and not manager.scheduler.has_unfinished()
