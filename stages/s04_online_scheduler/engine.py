"""InferenceEngine for stage 04: continuous batching on top of paged sessions.

The engine keeps its building blocks from stage 03 — sessions, prefill, one batched decode
step — and `generate` now drives them through an `OnlineScheduler`: a request is prefilled
as soon as there is a free decode slot and room in the KV pool, and leaves the batch the
step it finishes. Stage 03's batch loop, where finished rows waited, is gone.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from common.device import to_device
from common.loader import LoadedModel
from common.requests import Completion, PreparedPrompt, Request, finish_reason_for, int_knob, prepare_prompt
from common.sampling import make_generator, sample_tokens

from .attention import DecodeAttention, PrefillAttention
from .kv_cache import KVBlockPool, OutOfKVBlocks
from .session import InferenceSession


DEFAULT_TOKENS_PER_SLOT = 1024  # default KV pool: this many tokens per decode slot (see _num_blocks)


class InferenceEngine:
    """Generates completions for a list of requests, `max_batch_size` at a time, KV in paged blocks."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 8, block_size: int = 16,
                 kv_cache_max_concurrency: int | None = None, num_kv_blocks: int | None = None) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        int_knob("block_size", block_size, 1)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = loaded.config.max_position_embeddings
        self.eos_token_ids = loaded.config.eos_token_ids
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or (0,))[0])
        self.pool = KVBlockPool(loaded.config, self._num_blocks(block_size, kv_cache_max_concurrency, num_kv_blocks),
                                int(block_size), loaded.dtype, self.device)
        self._peak_blocks = 0
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # see _index

    def _num_blocks(self, block_size: int, concurrency: int | None, num_blocks: int | None) -> int:
        """The KV budget: a block count, or room for `concurrency` full-context sequences (the posts' knob).

        Neither given: room for every decode slot to hold DEFAULT_TOKENS_PER_SLOT tokens, and at
        least one full-context sequence — not max_batch_size full contexts, which for an 8k-context
        model would reserve gigabytes that short requests never touch (paging's whole point).
        """
        if num_blocks is not None and concurrency is not None:
            raise ValueError("num_kv_blocks and kv_cache_max_concurrency are two ways to size the pool: give one")
        if num_blocks is not None:
            return int_knob("num_kv_blocks", num_blocks, 1)
        if concurrency is None:
            tokens = max(self.max_batch_size * min(self.max_model_len, DEFAULT_TOKENS_PER_SLOT), self.max_model_len)
            return -(-tokens // int(block_size))
        return int_knob("kv_cache_max_concurrency", concurrency, 1) * -(-self.max_model_len // int(block_size))

    def kv_stats(self) -> dict:
        """Pool size, and the most KV memory sessions held at once (blocks in use x block bytes)."""
        return {
            "peak_kv_bytes": self._peak_blocks * self.pool.bytes_per_block,
            "pool_kv_bytes": self.pool.nbytes,
            "block_size": self.pool.block_size,
            "num_blocks": self.pool.allocator.num_blocks,
            "peak_blocks_in_use": self._peak_blocks,
        }

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run every request to completion with continuous batching; results in the order of `requests`."""
        from .scheduler import OnlineScheduler  # a layer above the engine (it drives one): imported where used

        submitted = time.perf_counter()
        # Validate and tokenize everything first: bad input fails before any work is done.
        prepared = [prepare_prompt(r, self.tokenizer, self.max_model_len) for r in requests]
        sessions = [self.new_session(r, p) for r, p in zip(requests, prepared)]
        scheduler = OnlineScheduler(self, self.max_batch_size)
        waiting = deque(range(len(sessions)))
        index_of: dict[int, int] = {}
        completions: list[Completion | None] = [None] * len(sessions)
        while waiting or scheduler.has_unfinished():
            # Admit while a decode slot and the request's KV blocks are free: it joins the next step.
            while waiting and scheduler.num_unfinished < self.max_batch_size:
                try:
                    rid = scheduler.add_session(sessions[waiting[0]], submitted=submitted)
                except OutOfKVBlocks:
                    break  # waits until a running request finishes and frees blocks
                index_of[rid] = waiting.popleft()
            scheduler.step()
            for rid in scheduler.pop_finished_ids():
                completions[index_of[rid]] = scheduler.pop_completion(rid)
        return completions  # type: ignore[return-value]

    def new_session(self, request: Request, prompt: PreparedPrompt) -> InferenceSession:
        """A session for a validated, tokenized request; fails if it could never fit in the pool."""
        session = InferenceSession(request, prompt.token_ids, prompt.truncated,
                                   make_generator(request.params, self.device), self.pool)
        need = session.worst_case_blocks(self.max_model_len)
        capacity = self.pool.allocator.num_blocks
        if need > capacity:
            # Name the field the client can change: the prompt if it cannot fit even with one new
            # token (a context window of prompt + 1 caps the worst case there), else max_new_tokens.
            alone = session.worst_case_blocks(len(session.prompt_ids) + 1)
            field = "prompt" if alone > capacity else "max_new_tokens"
            raise ValueError(f"{field}: a request needs {need} KV blocks (its prompt and the tokens it may generate) but "
                             f"the pool has only {capacity}; lower it or raise kv_cache_max_concurrency or num_kv_blocks")
        return session

    def reserve(self, session: InferenceSession) -> None:
        """Book the session's worst case in the pool (raises OutOfKVBlocks if it does not fit now)."""
        need = session.worst_case_blocks(self.max_model_len)
        self.pool.allocator.reserve(need)
        session.reserved = need

    def prefill(self, session: InferenceSession) -> torch.Tensor:
        """Run one prompt, writing its K/V into its blocks; returns the last logits [1, V]."""
        T = len(session.prompt_ids)
        ids = torch.tensor([session.prompt_ids], dtype=torch.long, device=self.device)  # [1, T]
        positions = torch.arange(T, device=self.device)[None]  # [1, T]
        slots = session.take_slots(T).to(self.device)
        last = torch.tensor([T - 1], device=self.device)
        return self.model(ids, positions, PrefillAttention(self.pool, slots), logits_indices=last)

    def decode_step_sessions(self, sessions: list[InferenceSession]) -> torch.Tensor:
        """One token for each session; returns logits [B, V].

        A finished session still in the batch (static batching keeps it until the batch ends) is
        fed its last token again and writes nothing: its row is computed and thrown away.
        Positions, block tables and lengths come from the device mirror (`pool.tables`), indexed
        by the sessions' rows: only the new token ids travel from Python.
        """
        writers = [i for i, s in enumerate(sessions) if not s.finished]
        for i in writers:
            sessions[i].make_room(1)  # a new block when the last one is full
        tables, bs = self.pool.tables, self.pool.block_size
        rows = self._index(tuple(s.row for s in sessions))  # [B]
        w = None if len(writers) == len(sessions) else self._index(tuple(writers))  # [W]
        w_rows = rows if w is None else rows[w]  # [W]
        positions = tables.lengths[rows]  # [B]: tokens cached before this one
        new_pos = positions if w is None else positions[w]  # [W]
        table = tables.table[w_rows]  # [W, max blocks]
        new_slots = table.gather(1, (new_pos // bs)[:, None])[:, 0] * bs + new_pos % bs  # [W]
        tables.lengths.index_add_(0, w_rows, torch.ones_like(w_rows))
        lengths = tables.lengths[rows]  # [B]: this step's token included (writers only)
        nb = -(-max(s.num_cached for s in sessions) // bs)  # blocks of the longest session
        attention = DecodeAttention(self.pool, new_slots, tables.table[rows, :nb], lengths, w)
        ids = to_device([[s.generated[-1]] for s in sessions], torch.long, self.device)  # [B, 1]
        first = self._index((0,) * len(sessions))
        return self.model(ids, positions[:, None], attention, logits_indices=first)  # [B, V]

    def _index(self, values: tuple[int, ...]) -> torch.Tensor:
        """`values` as a device tensor, made once per distinct batch (not every step)."""
        if values not in self._indices:
            if len(self._indices) > 16:
                self._indices.clear()
            self._indices[values] = to_device(values, torch.long, self.device)
        return self._indices[values]

    def sample_and_record(self, sessions: list[InferenceSession], logits: torch.Tensor) -> None:
        """Sample one token for every session (all live), record it, and decide who is done. logits: [B, V]."""
        tokens = sample_tokens(logits, [s.params for s in sessions], [s.generator for s in sessions])
        now = time.perf_counter()
        self._peak_blocks = max(self._peak_blocks, self.pool.allocator.num_blocks - self.pool.allocator.num_free)
        for s, tok in zip(sessions, tokens):
            s.generated.append(tok)
            s.timestamps.append(now)
            s.finish_reason = finish_reason_for(
                tok, len(s.generated), len(s.prompt_ids) + len(s.generated),
                s.params, self.eos_token_ids, self.max_model_len,
            )

    def completion(self, session: InferenceSession) -> Completion:
        """The public result of a finished session."""
        ts = dict(session.timings)
        if session.timestamps:
            ts.update(first_token=session.timestamps[0], finished=session.timestamps[-1])
        return Completion(
            prompt_token_ids=session.prompt_ids,
            token_ids=session.generated,
            text=self.tokenizer.decode(session.generated, skip_special_tokens=True),
            finish_reason=session.finish_reason or "length",
            token_timestamps=session.timestamps,
            truncated=session.truncated,
            timings=ts,
            prompt=session.request.prompt,
        )
