"""InferenceEngine for stage 06: a burst of new requests is prefilled in one batched forward.

Stage 05 prefilled requests one forward each. `prefill_sessions` takes all the sessions a
scheduler admits together: the prefix cache is consulted first, identical prompts inside the
burst are prefilled once and shared, and the remaining prompts go through the model as one
right-padded batch.
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
from .prefix_cache import PrefixCache, PrefixCacheKey
from .session import InferenceSession


DEFAULT_TOKENS_PER_SLOT = 1024  # default KV pool: this many tokens per decode slot (see _num_blocks)


class InferenceEngine:
    """Generates completions for a list of requests, `max_batch_size` at a time, KV in paged blocks."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 8, block_size: int = 16,
                 kv_cache_max_concurrency: int | None = None, num_kv_blocks: int | None = None,
                 prefix_cache_max_entries: int = 64) -> None:
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
        self.prefix_cache = PrefixCache(self.pool, prefix_cache_max_entries)
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
            "prefix_cache_entries": len(self.prefix_cache),
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_misses": self.prefix_cache.misses,
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
        while need > self.pool.allocator.num_available and self.prefix_cache.evict_one():
            pass  # cached prompts give their blocks back before a live request has to wait
        self.pool.allocator.reserve(need)
        session.reserved = need

    def prefix_cache_key(self, session: InferenceSession) -> PrefixCacheKey | None:
        """The prompt string (as in the post); requests given only as token ids are not cached."""
        return session.request.prompt or None

    def prefill_sessions(self, sessions: list[InferenceSession]) -> torch.Tensor:
        """Last logits [N, V] for new sessions: cache hits first, one forward for the distinct rest."""
        logits: list[torch.Tensor | None] = [None] * len(sessions)
        first_with_key: dict[PrefixCacheKey, int] = {}
        duplicates: list[tuple[int, int]] = []  # (session, the earlier session with the same key)
        todo: list[int] = []
        for i, s in enumerate(sessions):
            key = self.prefix_cache_key(s)
            if key is not None:
                cached = self.prefix_cache.attach(key, s)
                if cached is not None:
                    logits[i] = cached  # no forward pass: the blocks and logits are already there
                    continue
                earlier = first_with_key.get(key)
                # In-batch dedup: prefill once, share the blocks. The same key must mean the same
                # tokens, as PrefixCache.attach checks: the same text with a caller's own ids is no duplicate.
                if earlier is not None and sessions[earlier].prompt_ids == s.prompt_ids:
                    duplicates.append((i, earlier))
                    continue
                first_with_key[key] = i
            todo.append(i)
        if todo:
            batch_logits = self._prefill_forward([sessions[i] for i in todo])  # [len(todo), V]
            for row, i in enumerate(todo):
                logits[i] = batch_logits[row]
                key = self.prefix_cache_key(sessions[i])
                if key is not None:
                    self.prefix_cache.put(key, sessions[i], batch_logits[row])
        for i, src in duplicates:
            sessions[i].attach_blocks(sessions[src].block_table, sessions[src].num_cached)
            logits[i] = logits[src]
        return torch.stack(logits)  # type: ignore[arg-type]

    def prefill(self, session: InferenceSession) -> torch.Tensor:
        """One session's last logits [1, V] (a burst of one)."""
        return self.prefill_sessions([session])

    def _prefill_forward(self, sessions: list[InferenceSession]) -> torch.Tensor:
        """Run N prompts as one right-padded batch, writing their K/V to their blocks; logits [N, V]."""
        lengths = [len(s.prompt_ids) for s in sessions]
        N, T = len(sessions), max(lengths)
        ids = torch.full((N, T), self.pad_token_id, dtype=torch.long)  # [N, T]
        valid = torch.zeros((N, T), dtype=torch.bool)  # [N, T]
        for i, s in enumerate(sessions):
            ids[i, : lengths[i]] = torch.tensor(s.prompt_ids)
            valid[i, : lengths[i]] = True
        positions = torch.arange(T).expand(N, T)  # [N, T]
        slots = torch.cat([s.take_slots(n) for s, n in zip(sessions, lengths)])  # [sum(lengths)]
        last = torch.tensor(lengths) - 1  # [N]
        attention = PrefillAttention(self.pool, slots.to(self.device), valid.to(self.device))
        return self.model(ids.to(self.device), positions.to(self.device), attention, logits_indices=last.to(self.device))

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
