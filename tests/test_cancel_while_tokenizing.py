"""A request cancelled while the manager's tokenizer threads have it never reaches the engine.

Why: with `tokenize_workers` (`stagewise serve --tokenize-workers N`), a request is in neither of
the worker's queues while a tokenizer thread holds it. A cancel then (a client that leaves
during a burst) ended its handle, but the tokenizer queued it afterwards all the same, and it was
admitted and decoded to `max_new_tokens` for nobody: a batch slot and KV blocks taken from the
requests that are still wanted.
"""
from __future__ import annotations

import threading

import pytest

from common import stages as registry
from conftest import streaming_packages

STREAMING = streaming_packages()


@pytest.mark.parametrize("package", STREAMING, ids=registry.short_name)
def test_a_request_cancelled_while_it_is_tokenized_is_never_admitted(package, tiny) -> None:
    stage = registry.load_stage(package)
    engine = stage.InferenceEngine(tiny, max_batch_size=2)
    with stage.SchedulerManager(engine, max_batch_size=2, tokenize_workers=1) as manager:
        admitted: list[int] = []
        scheduler = manager.scheduler
        for name in ("add_request", "add_requests"):  # stages 04-05 admit one by one, 06+ a burst at once
            real = getattr(scheduler, name, None)
            if real is not None:
                def spy(*args, _real=real, **kwargs):
                    batch = args[0] if args and isinstance(args[0], list) else [kwargs]
                    admitted.extend(r["request_id"] if isinstance(r, dict) else r.request_id for r in batch)
                    return _real(*args, **kwargs)
                setattr(scheduler, name, spy)
        gate = threading.Event()
        manager._tokenizer_pool.submit(gate.wait)  # the one tokenizer thread is busy
        try:
            cancelled = manager.add_request("hello world", max_new_tokens=40, stop_on_eos=False)
            cancelled.cancel()
            assert cancelled.result(timeout=10).finish_reason == "cancelled"
        finally:
            gate.set()
        later = manager.add_request("Hi", max_new_tokens=2, stop_on_eos=False)  # tokenized after it
        assert len(later.result(timeout=30).token_ids) == 2
        assert admitted == [later.request_id]
