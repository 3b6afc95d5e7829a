"""OnlineScheduler: continuous batching over sessions that take KV blocks as they grow, and preemption.

As in stage 11, `add_request` / `add_requests` only admit and `step` is one forward under the
engine's token budget. What changes is the bookkeeping of blocks. Admission books only a
prompt's blocks, and only while one more block stays free for every running session; a decode
step takes a block when a sequence's last one fills. When a step needs more blocks than are
free, the most recently admitted running session is preempted (vLLM's and nano-vllm's policy):
its blocks go back, its tokens stay, and it waits at the head of the queue. Readmitted, it is
prefilled again over prompt + generated tokens (recompute) and samples its next token, as if it
had never stopped. At most `max_batch_size` sessions are admitted at once, as vLLM's
`max_num_seqs`: admitting more would only have them take blocks from each other.
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

# A request that outgrows the pool was allowed too many new tokens for it: the error starts with that
# field's name (a server puts the request's own name there, max_tokens), and says what to do.
OUTGROWN = "lower it or raise num_kv_blocks"


@dataclass
class OnlineRequest(Request):
    """A Request as the scheduler admits it: with the id and submit time the caller chose (optional)."""

    request_id: int | None = None
    submitted: float | None = None


class OnlineScheduler:
    """Owns the live sessions of one engine; not thread-safe (SchedulerManager drives it from one thread)."""

    def __init__(self, engine: "InferenceEngine", max_batch_size: int = 8) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        if engine.max_num_batched_tokens < int(max_batch_size):  # a full decode batch must fit in a step
            raise ValueError(f"max_num_batched_tokens ({engine.max_num_batched_tokens}) must be >= "
                             f"max_batch_size ({max_batch_size})")
        self.engine = engine
        self.max_batch_size = int(max_batch_size)
        self._sessions: dict[int, InferenceSession] = {}
        self._next_request_id = 0
        self._round_robin_pos = 0
        self._finished_ids: list[int] = []
        self._preempted: list[int] = []  # waiting to be readmitted, the most recently preempted first
        self._refused = False  # a request was kept out for want of blocks since the last step
        self._failed: dict[int, BaseException] = {}  # ended with an error since the last pop_failed()

    @torch.inference_mode()
    def add_request(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, request_id: int | None = None,
                    submitted: float | None = None, **sampling: Any) -> int:
        """Validate and admit (blocks booked, prompt queued for prefill); returns the request id.

        Sampling fields may be given as `params` or as keywords (max_new_tokens=..., as in the post).
        Raises ValueError for bad input and OutOfKVBlocks when the pool cannot hold the request yet.
        """
        eng = self.engine
        request = Request(prompt=prompt, prompt_token_ids=prompt_token_ids, params=SamplingParams.of(params, sampling))
        session = eng.new_session(request, prepare_prompt(request, eng.tokenizer, eng.max_model_len))
        return self.add_session(session, request_id=request_id, submitted=submitted)

    def add_session(self, session: "InferenceSession", request_id: int | None = None,
                    submitted: float | None = None) -> int:
        """Admit a prepared session: book its prompt's blocks and take its cached prefix; the
        prompt is prefilled by the coming steps, in chunks (its first token comes from the last)."""
        if request_id is not None and request_id in self._sessions:
            raise ValueError(f"request_id {request_id} is already in use")  # the old session would leak
        self._admit(session)  # raises OutOfKVBlocks, leaving nothing behind
        now = time.perf_counter()
        session.timings.setdefault("submitted", now if submitted is None else submitted)
        session.timings["scheduled"] = now
        if request_id is None:
            request_id = self._next_request_id
        self._next_request_id = max(self._next_request_id, request_id) + 1
        self._sessions[request_id] = session  # prefilling: dict order is arrival order
        return request_id

    def _admit(self, session: "InferenceSession", pending: int = 0) -> None:
        """Book a new session's prompt blocks, if it may come in now; raises OutOfKVBlocks if not.

        Not while a preempted session waits (it is at the head of the queue), not beyond
        max_batch_size sessions, and only if every running session (and every one admitted
        just before it in this burst, `pending`) could still take one more block: admission
        never forces a preemption at the next step. vLLM's block manager keeps a watermark of
        free blocks for the same reason; here it is sized by the batch, not by the pool."""
        running = self.num_unfinished + pending
        if self._preempted:
            raise OutOfKVBlocks("preempted requests are readmitted first")
        if running >= self.max_batch_size:
            raise OutOfKVBlocks(f"{running} requests admitted already, max_batch_size is {self.max_batch_size}")
        try:
            self.engine.reserve(session, headroom=running)
        except OutOfKVBlocks:
            self._refused = True
            raise

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._sessions

    def session(self, request_id: int) -> "InferenceSession":
        return self._sessions[request_id]

    def request_ids(self) -> list[int]:
        return list(self._sessions)

    @torch.inference_mode()
    def add_requests(self, requests: list[OnlineRequest]) -> list[int | BaseException]:
        """Admit a burst: validate and book each; the coming steps prefill them, in chunks.

        Returns, per request, its id — or the exception that kept it out (ValueError for bad
        input, OutOfKVBlocks when the pool cannot hold it yet): one bad request must not sink
        the burst. First come, first served, as vLLM's waiting queue: once one request must wait
        for blocks, every request after it waits too (else a stream of small ones that fit could
        keep a large one out for good).
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
                self._admit(session, pending=len(admitted))
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
        for rid, s in admitted:
            self._sessions[rid] = s
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
        """One forward: a token for up to max_batch_size decoding sessions, prompt chunks with the
        rest of the token budget; returns {request_id: token_id} (decoded, and first tokens of
        prompts this step finished)."""
        self._readmit()
        decoding = [(rid, s) for rid, s in self._sessions.items() if self._running(s) and not s.prefilling]
        prefilling = [(rid, s) for rid, s in self._sessions.items() if s.prefilling]
        if not decoding and not prefilling:
            return {}
        selected: list[tuple[int, "InferenceSession"]] = []
        if decoding:
            batch_size = min(self.max_batch_size, len(decoding))
            start = self._round_robin_pos % len(decoding)
            selected = [decoding[(start + i) % len(decoding)] for i in range(batch_size)]
            self._round_robin_pos = (start + batch_size) % len(decoding)
        selected = self._make_room(selected)
        prefilling = [(rid, s) for rid, s in prefilling if s.prefilling]  # a preempted one is not
        if not selected and not prefilling:
            return {}

        waiting, self._refused = bool(self._preempted) or self._refused, False
        logits, done = self.engine.step_sessions([s for _, s in selected], [s for _, s in prefilling], waiting)
        finished_prompts = {id(s) for s in done}
        selected += [(rid, s) for rid, s in prefilling if id(s) in finished_prompts]  # the order of logits' rows
        self.engine.sample_and_record([s for _, s in selected], logits)
        step_tokens: dict[int, int] = {}
        for rid, s in selected:
            step_tokens[rid] = s.generated[-1]
            if s.finished:
                self._finish(rid, s)
        return step_tokens

    @staticmethod
    def _running(s: "InferenceSession") -> bool:
        return not s.finished and not s.preempted

    def _make_room(self, selected: list[tuple[int, "InferenceSession"]]) -> list[tuple[int, "InferenceSession"]]:
        """Preempt until every selected decode session that starts a block this step can take one.

        The victim is the most recently admitted running session, selected or not (dict order is
        admission order, and a readmitted session counts as admitted again, as in vLLM: it is the
        first victim of the next shortage), so the requests that came first keep going.
        One that would have to preempt itself, alone in a dry pool, has outgrown the whole pool:
        it ends with an error (it could never finish), not in a wait that never ends."""
        alloc = self.engine.pool.allocator
        while sum(s.needs_block() for _, s in selected) > alloc.num_available:
            victims = [(rid, s) for rid, s in self._sessions.items() if self._running(s)]
            rid, victim = victims[-1]
            if len(victims) == 1:
                tokens = victim.num_cached + 1
                self._fail(rid, ValueError(
                    f"max_new_tokens: request {rid} grew to {tokens} tokens, past the whole KV pool of "
                    f"{alloc.num_blocks} blocks of {self.engine.pool.block_size}; {OUTGROWN}"))
            else:
                self.engine.preempt(victim)
                self._preempted.insert(0, rid)
            selected = [(r, s) for r, s in selected if r != rid]
        return selected

    def _readmit(self) -> None:
        """Preempted sessions come back first, the most recently preempted first (vLLM puts it at
        the head of its waiting queue), as soon as their blocks are free: each one's prefill is
        booked like a new prompt's (what the prefix cache still holds is taken back, not computed).
        Head of the line: until it fits, nobody behind it (preempted or new) comes in."""
        while self._preempted:
            rid = self._preempted[0]
            session = self._sessions[rid]
            running = sum(self._running(s) for s in self._sessions.values())
            if self.engine.blocks_for(session.prefill_target + 1) > self.engine.pool.allocator.num_blocks:
                self._preempted.pop(0)  # it cannot come back even alone
                self._fail(rid, ValueError(
                    f"max_new_tokens: request {rid} needs more than the whole KV pool to continue; {OUTGROWN}"))
                continue
            try:
                self.engine.reserve(session, headroom=running)
            except OutOfKVBlocks:
                if running:
                    return  # it waits for running sessions to finish
                self._preempted.pop(0)  # nothing runs, and it still does not fit
                self._fail(rid, ValueError(
                    f"max_new_tokens: request {rid} does not fit in the KV pool to continue; {OUTGROWN}"))
                continue
            self._preempted.pop(0)
            session.preempted = False
            del self._sessions[rid]
            self._sessions[rid] = session  # admitted again: the most recent admission now

    def _fail(self, request_id: int, error: BaseException) -> None:
        """End a request with an error: its blocks go back, its caller gets `error` (pop_failed)."""
        session = self._sessions.pop(request_id)
        session.release_kv_blocks()
        self._failed[request_id] = error

    def pop_failed(self) -> dict[int, BaseException]:
        """Requests that ended with an error since the last call, and their errors (each once)."""
        failed, self._failed = self._failed, {}
        return failed

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
        """Forget a request, finished or not (cancel), preempted or not; its blocks go back to the pool."""
        session = self._sessions.pop(request_id, None)
        if request_id in self._preempted:
            self._preempted.remove(request_id)
        if session is not None:
            session.release_kv_blocks()
            if request_id in self._finished_ids:
                self._finished_ids.remove(request_id)
