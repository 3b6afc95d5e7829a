"""A request's queue and handle (common/streams.py): the blocking side and the event loop's side.

`stagewise serve` reads streams without a thread per request: the worker's put calls a listener
that wakes the event loop, which drains the queue without blocking. These check that contract
with no model and no stage: every put is announced, nothing put before the listener is missed,
and drain() hands over the chunks in order, then the end (a Completion or the request's error).
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from common.requests import Completion
from common.streams import ChunkQueue, Done, Failed, RequestHandle, StreamChunk


class NoCancel:
    def cancel(self, request_id: int) -> None:
        raise AssertionError("not expected")


def _completion(ids: list[int]) -> Completion:
    return Completion(prompt_token_ids=[1], token_ids=ids, text="", finish_reason="length")


def test_listener_is_called_after_every_put_and_at_once_for_what_waits() -> None:
    out = ChunkQueue()
    out.put(StreamChunk("a", [1]))  # before anyone listens
    calls: list[int] = []
    handle = RequestHandle(NoCancel(), 7, out)
    handle.set_listener(lambda: calls.append(out.qsize()))
    assert calls == [1]  # told at once: an item was already waiting
    out.put(StreamChunk("b", [2]))
    assert calls == [1, 2]  # told after the item is in the queue, so a drain finds it
    chunks, end = handle.drain()
    assert [c.text for c in chunks] == ["a", "b"] and end is None
    assert handle.drain() == ([], None)  # nothing waits: returns at once


def test_drain_ends_with_the_completion_or_the_error() -> None:
    out = ChunkQueue()
    handle = RequestHandle(NoCancel(), 1, out)
    done = _completion([5, 6])
    for item in (StreamChunk("x", [5]), StreamChunk("y", [6]), Done(done)):
        out.put(item)
    chunks, end = handle.drain()
    assert [c.token_ids for c in chunks] == [[5], [6]] and end is done
    assert handle.result(timeout=1) is done  # the blocking side agrees

    failed = RequestHandle(NoCancel(), 2, ChunkQueue())
    failed._out.put(Failed(ValueError("prompt: too long")))
    chunks, end = failed.drain()
    assert chunks == [] and isinstance(end, ValueError)
    with pytest.raises(ValueError, match="too long"):
        failed.result(timeout=1)


def test_an_event_loop_reads_a_stream_put_by_another_thread() -> None:
    """The serving pattern end to end: a worker thread puts, the loop is woken and drains."""
    out = ChunkQueue()
    handle = RequestHandle(NoCancel(), 3, out)
    final = _completion(list(range(50)))

    async def read() -> tuple[list[int], Completion]:
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        handle.set_listener(lambda: loop.call_soon_threadsafe(ready.set))
        worker = threading.Thread(target=lambda: [out.put(StreamChunk(str(i), [i])) for i in range(50)]
                                  + [out.put(Done(final))])
        worker.start()
        got: list[int] = []
        while True:
            await asyncio.wait_for(ready.wait(), timeout=10)
            ready.clear()  # before draining: a put from here on sets it again
            chunks, end = handle.drain()
            got += [i for c in chunks for i in c.token_ids]
            if end is not None:
                worker.join(10)
                return got, end

    got, end = asyncio.run(read())
    assert got == list(range(50)) and end is final


def test_cancel_reaches_the_manager_once_and_not_after_the_end() -> None:
    class Counting:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def cancel(self, request_id: int) -> None:
            self.calls.append(request_id)

    manager = Counting()
    handle = RequestHandle(manager, 4, ChunkQueue())
    handle.cancel()
    handle.cancel()  # the stream's end and the response's clean-up may both ask
    assert manager.calls == [4]

    ended = RequestHandle(manager, 5, ChunkQueue())
    ended._out.put(Done(_completion([1])))
    ended.drain()
    ended.cancel()  # its end was read: nothing left to stop
    assert manager.calls == [4]


def test_take_all_empties_the_queue_in_order() -> None:
    out = ChunkQueue()
    items = [StreamChunk(t, [i]) for i, t in enumerate("abc")]
    for item in items:
        out.put(item)
    assert out.take_all() == items
    assert out.empty() and out.take_all() == []
    out.put(items[0])  # still a working queue afterwards
    assert out.get(timeout=1) is items[0]
