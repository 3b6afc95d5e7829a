"""OnlineScheduler: continuous batching over InferenceSessions (post 011, "Online Scheduler").

`add_request` prefills a new request at once and returns its id — and `add_requests` admits a
whole burst with one batched prefill (in-batch duplicates prefilled once); `step` decodes one token
for up to `max_batch_size` unfinished sessions (round-robin when there are more). A
session that finishes gives its KV blocks back immediately, and a request added between
two steps joins the very next decode — nobody waits for a batch to drain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from common.requests import Completion, Request, SamplingParams, int_knob, prepare_prompt

from .kv_cache import OutOfKVBlocks

if TYPE_CHECKING:
    from .engine import InferenceEngine
    from .session import InferenceSession


@dataclass
class OnlineRequest(Request):
    """A Request as the scheduler admits it: with the id and submit time the caller chose (optional)."""

    request_id: int | None = None
    submitted: float | None = None


class OnlineScheduler:
    """Owns the live sessions of one engine; not thread-safe (SchedulerManager drives it from one thread)."""

    def __init__(self, engine: "InferenceEngine", max_batch_size: int = 8) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        self.engine = engine
        self.max_batch_size = int(max_batch_size)
        self._sessions: dict[int, InferenceSession] = {}
        self._next_request_id = 0
        self._round_robin_pos = 0
        self._finished_ids: list[int] = []

    @torch.inference_mode()
    def add_request(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, request_id: int | None = None,
                    submitted: float | None = None, **sampling: Any) -> int:
        """Validate, prefill and sample the first token now; returns the request id.

        Sampling fields may be given as `params` or as keywords (max_new_tokens=..., as in the post).
        Raises ValueError for bad input and OutOfKVBlocks when the pool cannot hold the request yet.
        """
        eng = self.engine
        request = Request(prompt=prompt, prompt_token_ids=prompt_token_ids, params=SamplingParams.of(params, sampling))
        session = eng.new_session(request, prepare_prompt(request, eng.tokenizer, eng.max_model_len))
        return self.add_session(session, request_id=request_id, submitted=submitted)

    def add_session(self, session: "InferenceSession", request_id: int | None = None,
                    submitted: float | None = None) -> int:
        """Admit a prepared session: book its worst-case blocks, prefill, sample its first token."""
        eng = self.engine
        if request_id is not None and request_id in self._sessions:
            raise ValueError(f"request_id {request_id} is already in use")  # the old session would leak
        eng.reserve(session)  # raises OutOfKVBlocks, leaving nothing behind
        now = time.perf_counter()
        session.timings.setdefault("submitted", now if submitted is None else submitted)
        session.timings["scheduled"] = now
        try:
            eng.sample_and_record([session], eng.prefill(session))
        except BaseException:
            session.release_kv_blocks()
            raise
        if request_id is None:
            request_id = self._next_request_id
        self._next_request_id = max(self._next_request_id, request_id) + 1
        self._sessions[request_id] = session
        if session.finished:
            self._finish(request_id, session)
        return request_id

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._sessions

    def session(self, request_id: int) -> "InferenceSession":
        return self._sessions[request_id]

    def request_ids(self) -> list[int]:
        return list(self._sessions)

    @torch.inference_mode()
    def add_requests(self, requests: list[OnlineRequest]) -> list[int | BaseException]:
        """Admit a burst: validate and book each, then ONE batched prefill for all of them.

        Returns, per request, its id — or the exception that kept it out (ValueError for bad
        input, OutOfKVBlocks when the pool cannot hold it yet, the batched prefill's error for
        the requests it ran): one bad request must not sink the burst. First come, first served,
        as vLLM's waiting queue: once one request must wait for blocks, every request after it
        waits too (else a stream of small ones that fit could keep a large one out for good).
        """
        eng = self.engine
        results: list[int | BaseException] = []
        admitted: list[tuple[int, "InferenceSession"]] = []
        waits: OutOfKVBlocks | None = None
        for req in requests:
            if waits is not None:
                results.append(OutOfKVBlocks(f"an earlier request of the burst waits for KV blocks: {waits}"))
                continue
            try:
                if req.request_id is not None and (req.request_id in self._sessions or req.request_id in results):
                    raise ValueError(f"request_id {req.request_id} is already in use")  # the old session would leak
                session = eng.new_session(req, prepare_prompt(req, eng.tokenizer, eng.max_model_len))
                eng.reserve(session)
            except OutOfKVBlocks as exc:
                results.append(exc)
                waits = exc
                continue
            except Exception as exc:
                results.append(exc)
                continue
            rid = self._next_request_id if req.request_id is None else req.request_id
            self._next_request_id = max(self._next_request_id, rid) + 1
            admitted.append((rid, session))
            results.append(rid)
        if not admitted:
            return results
        sessions = [s for _, s in admitted]
        now = time.perf_counter()
        for req, s in zip((r for r, res in zip(requests, results) if isinstance(res, int)), sessions):
            s.timings.setdefault("submitted", now if req.submitted is None else req.submitted)
            s.timings["scheduled"] = now
        try:
            eng.sample_and_record(sessions, eng.prefill_sessions(sessions))
        except BaseException as exc:
            for s in sessions:
                s.release_kv_blocks()
            if not isinstance(exc, Exception):
                raise  # Ctrl-C and the like end the call
            return [exc if isinstance(r, int) else r for r in results]  # its requests get the error; the rest keep theirs
        for rid, s in admitted:
            self._sessions[rid] = s
            if s.finished:
                self._finish(rid, s)
        return results

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self._sessions.values())

    @property
    def num_unfinished(self) -> int:
        return sum(not s.finished for s in self._sessions.values())

    def is_finished(self, request_id: int) -> bool:
        return self._sessions[request_id].finished

    @torch.inference_mode()
    def step(self) -> dict[int, int]:
        """Decode one token for up to max_batch_size unfinished sessions; returns {request_id: token_id}."""
        active = [(rid, s) for rid, s in self._sessions.items() if not s.finished]
        if not active:
            return {}
        batch_size = min(self.max_batch_size, len(active))
        start = self._round_robin_pos % len(active)
        selected = [active[(start + i) % len(active)] for i in range(batch_size)]
        self._round_robin_pos = (start + batch_size) % len(active)

        sessions = [s for _, s in selected]
        self.engine.sample_and_record(sessions, self.engine.decode_step_sessions(sessions))
        step_tokens: dict[int, int] = {}
        for rid, s in selected:
            step_tokens[rid] = s.generated[-1]
            if s.finished:
                self._finish(rid, s)
        return step_tokens

    def _finish(self, request_id: int, session: "InferenceSession") -> None:
        session.release_kv_blocks()  # at once: the next request can use them this very step
        self._finished_ids.append(request_id)

    def pop_finished_ids(self) -> list[int]:
        """Ids that finished since the last call (each reported once)."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def get_response(self, request_id: int) -> str:
        return self.get_completion(request_id).text

    def pop_response(self, request_id: int) -> str:
        return self.pop_completion(request_id).text

    def get_completion(self, request_id: int) -> Completion:
        return self.engine.completion(self._sessions[request_id])

    def pop_completion(self, request_id: int) -> Completion:
        return self.engine.completion(self._sessions.pop(request_id))

    def discard_request(self, request_id: int) -> None:
        """Forget a request, finished or not (cancel); its blocks go back to the pool."""
        session = self._sessions.pop(request_id, None)
        if session is not None:
            session.release_kv_blocks()
            if request_id in self._finished_ids:
                self._finished_ids.remove(request_id)
