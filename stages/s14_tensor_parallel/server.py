"""SchedulerManager: a worker thread that serves many callers from one OnlineScheduler.

Callers `add_request` from any thread and get a `RequestHandle` back at once. The worker
thread owns the scheduler: it admits pending requests into the running batch, runs steps
(decode tokens and prompt chunks, one forward each), and pushes each request's tokens —
detokenized incrementally and flushed every `stream_interval` tokens — onto that request's
own output queue. A failing request gets its error on its own stream; the worker and the
other requests carry on.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.requests import Completion, Request, SamplingParams, float_knob, int_knob
from common.streams import ChunkQueue, Done, Failed, Pending, RequestHandle, StreamChunk, StreamState
from common.threads import release_caller_openmp_threads
from common.tokenizer import IncrementalDetokenizer, encode

from .engine import InferenceEngine
from .kv_cache import OutOfKVBlocks
from .scheduler import OnlineRequest, OnlineScheduler


class SchedulerManager:
    """Thread-safe front of an OnlineScheduler: add_request from anywhere, one worker runs the model."""

    def __init__(self, engine: InferenceEngine, max_batch_size: int = 8, record_token_timestamps: bool = False,
                 stream_interval: int = 1, tokenize_workers: int = 0,
                 prefill_max_batch_size: int | None = None,
                 max_queue_delay_ms: float = 0.0, queue_quiet_ms: float = 5.0) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        # How many pending requests one worker iteration admits (prefills); None = max_batch_size,
        # the old behaviour. Decoupled from the decode batch size, which stays max_batch_size.
        if prefill_max_batch_size is None:
            prefill_max_batch_size = max_batch_size
        self._prefill_max_batch_size = int_knob("prefill_max_batch_size", prefill_max_batch_size, 1)
        int_knob("stream_interval", stream_interval, 1)
        int_knob("tokenize_workers", tokenize_workers, 0)
        float_knob("max_queue_delay_ms", max_queue_delay_ms)
        float_knob("queue_quiet_ms", queue_quiet_ms)
        self.engine = engine
        self.scheduler = OnlineScheduler(engine, max_batch_size=int(max_batch_size))
        self.record_token_timestamps = record_token_timestamps
        self.stream_interval = int(stream_interval)
        self.max_queue_delay_s = float(max_queue_delay_ms) / 1000.0  # 0: admit at once (off)
        self.queue_quiet_s = float(queue_quiet_ms) / 1000.0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: queue.Queue[Pending] = queue.Queue()
        self._waiting: list[Pending] = []  # drained from pending, but the KV pool was full (worker only)
        self._queues: dict[int, queue.Queue[Any]] = {}
        self._detoks: dict[int, IncrementalDetokenizer] = {}
        self._stream_states: dict[int, StreamState] = {}
        self._cancelled: set[int] = set()
        self._wakeup = threading.Event()
        self._collecting = False  # the idle worker is holding admission for a burst (_wait_for_burst)
        self._last_arrival = 0.0  # perf_counter of the latest add_request, for the quiet window
        self._running = True
        self._tokenizer_pool = ThreadPoolExecutor(int(tokenize_workers)) if tokenize_workers else None
        # From here on the worker runs the model: the caller's idle OpenMP threads would make
        # the worker's own threads sleep between parallel regions (common/threads.py).
        release_caller_openmp_threads()
        self._worker = threading.Thread(target=self._worker_loop, name="stagewise-worker", daemon=True)
        self._worker.start()

    # ---- caller side -------------------------------------------------------------------

    def add_request(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, **sampling: Any) -> RequestHandle:
        """Queue a request and return at once. Bad input fails this request's stream, nothing else."""
        submitted = time.perf_counter()
        rid = next(self._ids)
        out = ChunkQueue()
        handle = RequestHandle(self, rid, out)
        with self._lock:
            if not self._running:
                raise RuntimeError("SchedulerManager is closed")
            self._queues[rid] = out
        try:
            request = Request(prompt=prompt, prompt_token_ids=prompt_token_ids, params=SamplingParams.of(params, sampling))
        except Exception as exc:  # e.g. an unknown sampling keyword
            self._fail(rid, exc)
            return handle
        pending = Pending(rid, request, {"submitted": submitted})
        if self._tokenizer_pool is not None and request.prompt_token_ids is None:
            self._tokenizer_pool.submit(self._tokenize_and_enqueue, pending)
        else:
            self._tokenize_and_enqueue(pending)
        return handle

    def _tokenize_and_enqueue(self, pending: Pending) -> None:
        req = pending.request
        try:
            if req.prompt_token_ids is None and req.prompt:
                req.prompt_token_ids = encode(self.engine.tokenizer, req.prompt)
        except Exception as exc:
            self._fail(pending.request_id, exc)
            return
        self._last_arrival = pending.timings["tokenized"] = time.perf_counter()
        self._pending.put(pending)
        # While the idle worker collects a burst, wake it only when the batch is full: it times
        # the quiet window from _last_arrival itself, and a wake per arrival would take the GIL
        # from the thread submitting the rest of the burst, 64 times in a burst of 64.
        full = min(self._prefill_max_batch_size, self.scheduler.max_batch_size)  # one admission's most
        if not self._collecting or self._pending.qsize() >= full:
            self._wakeup.set()

    def cancel(self, request_id: int) -> None:
        """Stop a request; its stream ends with finish_reason "cancelled" and the tokens so far."""
        with self._lock:
            if request_id in self._queues:
                self._cancelled.add(request_id)
        self._wakeup.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker. Every request still in flight ends (cancelled); none is left hanging."""
        with self._lock:
            self._running = False
        self._wakeup.set()
        self._worker.join(timeout)
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=True)
        if not self._worker.is_alive():
            self._cancel_everything()  # the worker is gone: end whatever is left
            return
        # Still inside a long step: the scheduler belongs to the worker (not thread-safe), so here we
        # only end the handles; the worker gives their blocks back when the step returns and it exits.
        with self._lock:
            left = list(self._queues)
        for rid in left:
            self._end_unscheduled(rid)

    def __enter__(self) -> "SchedulerManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker side -------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while True:
            with self._lock:
                if not self._running:
                    break
            try:
                self._handle_cancellations()
                self._wait_for_burst()
                self._admit_pending()
                if self.scheduler.has_unfinished():
                    self._run_decode_once()
                elif not self._waiting:  # a request waiting for KV blocks is retried at once: nothing holds them now
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
            except Exception as exc:  # a bug outside the model's step: were the worker to die, every
                self._fail_scheduled(exc)  # request would hang; those it holds end with the error instead
        self._cancel_everything()

    def _wait_for_burst(self) -> None:
        """An idle worker holds its first admission until the pending queue has been quiet for
        queue_quiet_ms, and never longer than max_queue_delay_ms (0, the default: no wait).

        Why: the requests of one burst reach the manager spread over milliseconds (tens over
        HTTP). Admitted at once, the first arrival is prefilled alone and a decode step runs
        before the rest get in, so most of the burst waits a prefill and a step for its first
        token. A short wait lets the burst share one batched prefill. This is Triton's dynamic
        batcher's `max_queue_delay_microseconds` (TorchServe: `max_batch_delay`), with a quiet
        window so a lone request waits queue_quiet_ms, not the whole maximum. Only when nothing
        runs: a busy worker admits newcomers at every step, and waiting there would stall the
        running requests' tokens (vLLM's `scheduler_delay_factor` is the knob for that case).
        Meanwhile arrivals do not wake the worker (only a full batch does): it sleeps until the
        window could end, then looks at `_last_arrival`.
        """
        if self.max_queue_delay_s <= 0 or self._waiting or self.scheduler.has_unfinished():
            return
        if self._pending.qsize() == 0:
            return
        # What one admission takes: at most max_batch_size sessions are admitted at once (scheduler.py)
        start, full = time.perf_counter(), min(self._prefill_max_batch_size, self.scheduler.max_batch_size)
        self._collecting = True  # from here, add_request wakes us only when the batch is full
        try:
            while self._pending.qsize() < full and self._running:  # close() ends the wait
                timeout = min(self._last_arrival + self.queue_quiet_s, start + self.max_queue_delay_s) - time.perf_counter()
                if timeout <= 0:
                    return
                self._wakeup.clear()
                if self._pending.qsize() < full and self._running:  # after clear(): a full batch or close() just before it is not missed
                    self._wakeup.wait(timeout)
        finally:
            self._collecting = False

    def _admit_pending(self) -> None:
        """Drain up to prefill_max_batch_size pending requests into ONE add_requests call (admitted
        together; the steps then prefill them in chunks under the token budget)."""
        batch = self._waiting
        self._waiting = []
        while len(batch) < self._prefill_max_batch_size:
            try:
                p = self._pending.get_nowait()
            except queue.Empty:
                break
            if p.request_id in self._queues:  # else cancelled while the tokenizer had it: its handle has ended
                batch.append(p)
        if not batch:
            return
        idle = not self.scheduler.has_unfinished()  # then only prefix-cache entries (evictable) hold blocks
        requests = [
            OnlineRequest(prompt=p.request.prompt, prompt_token_ids=p.request.prompt_token_ids, params=p.request.params,
                          request_id=p.request_id, submitted=p.timings["submitted"])
            for p in batch
        ]
        try:
            results = self.scheduler.add_requests(requests)
        except Exception as exc:  # a bug in admission itself (else add_requests answers per request): the whole burst gets it
            results = [exc] * len(batch)
        for i, (p, result) in enumerate(zip(batch, results)):
            if isinstance(result, OutOfKVBlocks):
                if idle and i == 0:  # the first of the burst, and the pool was as free as it gets: it never fits
                    self._fail(p.request_id, ValueError(
                        f"prompt: request {p.request_id} does not fit in the KV pool even when it is idle; "
                        "shorten it or raise kv_cache_max_concurrency or num_kv_blocks"))
                else:  # waits for the blocks of running requests, or of its own burst (even finished ones)
                    self._waiting.append(p)
                continue
            if isinstance(result, BaseException):
                self._fail(p.request_id, result)
                continue
            session = self.scheduler.session(p.request_id)
            session.timings.update(tokenized=p.timings["tokenized"])
            with self._lock:
                self._detoks[p.request_id] = IncrementalDetokenizer(self.engine.tokenizer)
                self._stream_states[p.request_id] = StreamState()
            # No token yet: the prompt is prefilled by the coming steps, and its first token
            # streams out of _run_decode_once like every other.

    def _run_decode_once(self) -> None:
        """One decode step. The lock is taken ONCE per step, not once per token (post 052).

        Under the lock: only dict lookups, collecting every request's queue, detokenizer and
        stream state. Outside it: detokenize, flush and put. add_request callers contend for
        the same lock, so holding it briefly once beats taking it batch-size times.
        """
        try:
            step_tokens = self.scheduler.step()
        except Exception as exc:  # e.g. out of device memory: the running requests fail, the worker goes on
            self._fail_scheduled(exc)
            return
        for rid, error in self.scheduler.pop_failed().items():  # outgrew the whole pool: its stream ends with the error
            with self._lock:
                q, state = self._queues.get(rid), self._stream_states.get(rid)
            if q is not None and state is not None and state.token_ids:  # its tokens so far first, none lost
                q.put(StreamChunk(state.text, state.token_ids))
            self._fail(rid, error)
        finished_ids = self.scheduler.pop_finished_ids()
        with self._lock:
            step_records = [
                (token_id, self._queues.get(rid), self._detoks.get(rid), self._stream_states.get(rid))
                for rid, token_id in step_tokens.items()
            ]
            finished_records = [
                (rid, self._queues.pop(rid, None), self._detoks.pop(rid, None), self._stream_states.pop(rid, None))
                for rid in finished_ids
            ]
            self._cancelled.difference_update(finished_ids)
        try:
            for token_id, q, detok, state in step_records:
                self._push_token(q, detok, state, token_id)
        finally:  # the finished have left _queues: if a push failed (a bug), only here do they end
            for rid, q, detok, state in finished_records:
                self._complete(rid, q, detok, state)

    def _push_token(self, q: "queue.Queue[Any] | None", detok: IncrementalDetokenizer | None,
                    state: StreamState | None, token_id: int) -> None:
        """Detokenize one token and flush the stream every stream_interval tokens."""
        if q is None or detok is None or state is None:
            return
        state.token_ids.append(token_id)
        state.text += detok.add(token_id)
        if len(state.token_ids) >= self.stream_interval:
            q.put(StreamChunk(state.text, state.token_ids))
            state.token_ids, state.text = [], ""

    def _finish(self, rid: int, finish_reason: str | None = None) -> None:
        """Flush what is left, send the Completion, forget the request."""
        with self._lock:
            q = self._queues.pop(rid, None)
            detok = self._detoks.pop(rid, None)
            state = self._stream_states.pop(rid, None)
            self._cancelled.discard(rid)
        self._complete(rid, q, detok, state, finish_reason)

    def _complete(self, rid: int, q: "queue.Queue[Any] | None", detok: IncrementalDetokenizer | None,
                  state: StreamState | None, finish_reason: str | None = None) -> None:
        """Send the last text and the Completion; the request leaves the scheduler (blocks freed).
        Its queue has left `_queues` already: if making its end fails, only here can it be told."""
        try:
            completion = self.scheduler.get_completion(rid)
            tail = (state.text if state else "") + (detok.flush() if detok else "")
        except Exception as exc:  # a bug: this request ends with it, and the others go on
            self.scheduler.discard_request(rid)
            if q is not None:
                q.put(Failed(exc))
            return
        self.scheduler.discard_request(rid)  # returns its blocks, finished or not
        if q is None:
            return
        if state is not None and (state.token_ids or tail):
            q.put(StreamChunk(tail, state.token_ids))
        if finish_reason is not None:
            completion.finish_reason = finish_reason
        if not self.record_token_timestamps:
            completion.token_timestamps = []
        q.put(Done(completion))

    def _handle_cancellations(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for rid in cancelled:
            if rid in self.scheduler:
                self._finish(rid, finish_reason="cancelled")
            else:  # still pending (or waiting for KV): end it when the worker reaches it
                self._drop_pending(rid)

    def _drop_pending(self, rid: int) -> None:
        before = len(self._waiting)
        self._waiting = [p for p in self._waiting if p.request_id != rid]
        if len(self._waiting) == before:
            kept = []
            while True:
                try:
                    p = self._pending.get_nowait()
                except queue.Empty:
                    break
                if p.request_id != rid:
                    kept.append(p)
            for p in kept:
                self._pending.put(p)
        self._end_unscheduled(rid)

    def _end_unscheduled(self, rid: int) -> None:
        with self._lock:
            q = self._queues.pop(rid, None)
        if q is not None:
            q.put(Done(Completion(prompt_token_ids=[], token_ids=[], text="", finish_reason="cancelled")))

    def _fail_scheduled(self, error: BaseException) -> None:
        """End every request the scheduler holds with `error`; their blocks go back to the pool."""
        for rid in self.scheduler.request_ids():
            self.scheduler.discard_request(rid)
            self._fail(rid, error)

    def _fail(self, rid: int, error: BaseException) -> None:
        with self._lock:
            q = self._queues.pop(rid, None)
            self._detoks.pop(rid, None)
            self._stream_states.pop(rid, None)
        if q is not None:
            q.put(Failed(error))

    def _cancel_everything(self) -> None:
        """End every request that is still known: running ones with their tokens so far."""
        for rid in self.scheduler.request_ids():
            if rid in self._queues:
                self._finish(rid, finish_reason="cancelled")
            else:
                self.scheduler.discard_request(rid)
        with self._lock:
            left = list(self._queues)
        for rid in left:
            self._end_unscheduled(rid)
