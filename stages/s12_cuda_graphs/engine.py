"""InferenceEngine for stage 12: decode-only steps replay CUDA graphs, one per padded batch size and table width.

Stage 11's step is one forward under a token budget; on a GPU a decode step of it is the host
launching a few hundred small kernels from Python while the GPU mostly waits. Now a step with
no prompt chunk in it goes through `DecodeGraphs` (cuda_graphs.py): its inputs are copied into
static buffers padded to a captured bucket, and one `replay()` launches the whole forward.
Steps with prompt chunks, and batches above the largest bucket, run eagerly, exactly as stage
11. On a CPU nothing is captured, and the engine runs eagerly unless `enforce_eager=False` asks
for the padded path (the tests do, so CI runs every line but the capture). `enforce_eager=True`
(vLLM's name) skips the graphs on a GPU too.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from common.device import to_device
from common.loader import LoadedModel
from common.requests import Completion, PreparedPrompt, Request, finish_reason_for, int_knob, prepare_prompt
from common.sampling import make_generator, sample_tokens

from .attention import DecodeAttention, PrefillAttention, StepAttention
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys
from .session import InferenceSession


DEFAULT_TOKENS_PER_SLOT = 1024  # default KV pool: this many tokens per decode slot (see _num_blocks)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # tokens per step on this CPU: decode rows + a prompt chunk (see BENCH)


class InferenceEngine:
    """Generates completions for a list of requests, `max_batch_size` at a time, KV in paged blocks."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 8, block_size: int = 16,
                 kv_cache_max_concurrency: int | None = None, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 enforce_eager: bool | None = None, max_cudagraph_capture_size: int | None = None) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        int_knob("block_size", block_size, 1)
        if not isinstance(enable_prefix_caching, bool):  # "no" would be true
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        if enforce_eager is not None and not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool or None, got {enforce_eager!r}")
        int_knob("max_num_batched_tokens", max_num_batched_tokens, 1)
        if max_num_batched_tokens < max_batch_size:  # vLLM's rule too: decode rows alone must fit
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_batch_size ({max_batch_size})")
        # At most 512 rows by default, as vLLM's default (min(2 x max_num_seqs, 512)): a larger decode
        # batch runs eagerly, its kernels long enough that launches no longer dominate.
        capture_size = min(max_batch_size, 512) if max_cudagraph_capture_size is None else max_cudagraph_capture_size
        int_knob("max_cudagraph_capture_size", capture_size, 1)
        if capture_size > max_batch_size:  # vLLM's name; above the batch it could never be used
            raise ValueError(f"max_cudagraph_capture_size must be between 1 and max_batch_size ({max_batch_size}), "
                             f"not {max_cudagraph_capture_size}")
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = loaded.config.max_position_embeddings
        self.group = loaded.config.num_heads // loaded.config.num_kv_heads  # query heads per KV head
        self.eos_token_ids = loaded.config.eos_token_ids
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or (0,))[0])
        self.pool = KVBlockPool(loaded.config, self._num_blocks(block_size, kv_cache_max_concurrency, num_kv_blocks),
                                int(block_size), loaded.dtype, self.device)
        self.prefix_cache = PrefixCache(self.pool, enable_prefix_caching)
        self._peak_blocks = 0
        self.graph_steps = self.eager_steps = 0  # steps run through the decode graphs, and the rest
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # see _index
        # Graphs save kernel launches, which only a GPU has: on a CPU the buckets' padding would be
        # all cost, so the default there is eager, as in vLLM's CPU backend. enforce_eager=False
        # runs the padded path on a CPU anyway (the tests do: every line but the capture and replay).
        if enforce_eager is None:
            enforce_eager = self.device.type != "cuda"
        # Captured now, once, after the pool exists (the graphs read its block tables and blocks).
        self.graphs = None if enforce_eager else DecodeGraphs(self, capture_size)

    def close(self) -> None:
        """Give the graphs and their memory pool back (the engine still runs, eagerly)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

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
            "prefix_cache_blocks": len(self.prefix_cache),
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_misses": self.prefix_cache.misses,
            "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens,
            "prefix_cache_query_tokens": self.prefix_cache.query_tokens,
            "cudagraphs": len(self.graphs.graphs) if self.graphs is not None else 0,
            "cudagraph_capture_s": self.graphs.capture_s if self.graphs is not None else 0.0,
            "cudagraph_pool_bytes": self.graphs.pool_bytes if self.graphs is not None else 0,
            "graph_steps": self.graph_steps,  # decode-only steps through a bucket (replays on a GPU)
            "eager_steps": self.eager_steps,  # with prompt chunks, above the largest bucket, or enforce_eager
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
        """Take the session's cached prefix blocks and book the rest of its worst case (raises
        OutOfKVBlocks, leaving nothing behind, if it does not fit now).

        Cached blocks nobody holds count as free, so a hit on one of those needs a booking too:
        taking it back out of the free blocks is an allocation like any other.
        """
        session.block_keys = block_keys(session.prompt_ids, self.pool.block_size)
        hits = self.prefix_cache.match(session.prompt_ids, session.block_keys)
        revived = sum(self.pool.allocator.ref_counts[b] == 0 for b in hits)
        need = session.worst_case_blocks(self.max_model_len) - len(hits) + revived
        self.pool.allocator.reserve(need)
        session.reserved = need
        session.attach_blocks(hits)  # pinned now: nothing this burst allocates can evict them

    def step_sessions(self, decode: list[InferenceSession],
                      prefilling: list[InferenceSession]) -> tuple[torch.Tensor, list[InferenceSession]]:
        """One forward for one scheduler step; returns logits [B + M, V] and the M sessions whose prompt it finished.

        The budget (`max_num_batched_tokens`) pays for one token per decode session first, then
        for prompt chunks of `prefilling`, in order, until it runs out: a prompt longer than
        what is left gets a chunk now and the rest in later steps. Before its chunk, a prompt
        takes any further cached blocks (its chunk then starts at the first uncached block),
        also the blocks an earlier chunk of this same forward completes (`pending`): every
        chunk's K/V of a layer is written before any chunk attends. Logits rows: the decode
        sessions', then one per finished prompt (its last token's).
        """
        bs = self.pool.block_size
        budget = self.max_num_batched_tokens - len(decode)
        pending: dict[BlockKey, int] = {}
        chunks: list[tuple[InferenceSession, int]] = []  # (session, first position of its chunk)
        slots: list[torch.Tensor] = []
        for s in prefilling:
            if budget <= 0:
                break
            if s.num_cached == len(s.block_table) * bs:  # at a block boundary: more may be cached by now
                more = self.prefix_cache.match(s.prompt_ids, s.block_keys, pending)[len(s.block_table):]
                if more:
                    s.attach_blocks(more)
            start = s.num_cached
            n = min(len(s.prompt_ids) - start, budget)
            budget -= n
            slots.append(s.take_slots(n))
            chunks.append((s, start))
            for i in range(start // bs, (start + n) // bs):  # the full blocks this chunk completes
                pending.setdefault(s.block_keys[i], s.block_table[i])
        logits = self._step_forward(decode, chunks, slots)
        done = [s for s, _ in chunks if s.num_cached == len(s.prompt_ids)]
        for s, _ in chunks:  # only now: their K/V exist (a failed forward leaves nothing cached)
            self.prefix_cache.insert(s.prompt_ids, s.block_keys[: s.num_cached // bs], s.block_table)
        for s in done:
            self.prefix_cache.count(len(s.prompt_ids), s.reused_blocks)
        return logits, done

    def _step_forward(self, decode: list[InferenceSession], chunks: list[tuple[InferenceSession, int]],
                      slots: list[torch.Tensor]) -> torch.Tensor:
        """Decode tokens, then each chunk's prompt tokens, packed into one row `[1, B + sum n]`; logits [B + M, V].
        The chunks' blocks and `slots` ([sum n]) are taken already."""
        B = len(decode)
        ids: list[int] = [s.generated[-1] for s in decode]
        graphs = self.graphs  # read once: close() may drop them (it belongs after the manager's close)
        if decode and not chunks and graphs is not None and graphs.fits(B):
            self.graph_steps += 1
            return graphs.run(ids, *self._decode_inputs(decode))  # [B, V]: decode only, a replay
        self.eager_steps += 1
        positions: list[int] = []  # the prompt tokens'; the decode rows' come from the device mirror
        decode_positions, decode_attention = self._decode_attention(decode) if decode else (None, None)
        prefill_attention, rows = None, list(range(B))
        if chunks:
            spans = []
            for s, start in chunks:
                n = s.num_cached - start
                spans.append((len(ids) - B, start, n))  # (offset among the prompt tokens, first position, tokens)
                ids += s.prompt_ids[start:start + n]
                positions.extend(range(start, start + n))
                if s.num_cached == len(s.prompt_ids):
                    rows.append(len(ids) - 1)  # the prompt's last token: sample its first output token
            prefill_attention = PrefillAttention(self.pool, torch.cat(slots).to(self.device), spans,
                                                 [s.block_table for s, _ in chunks], self.group)
        attention = StepAttention(decode_attention, prefill_attention, B)
        ids_t = to_device([ids], torch.long, self.device)  # [1, B + sum n]
        pos_t = to_device(positions, torch.long, self.device)  # [sum n]
        if decode_positions is not None:
            pos_t = torch.cat([decode_positions, pos_t])  # [B + sum n]
        return self.model(ids_t, pos_t[None], attention, logits_indices=to_device(rows, torch.long, self.device))  # [B + M, V]

    def _decode_attention(self, sessions: list[InferenceSession]) -> tuple[torch.Tensor, DecodeAttention]:
        """Positions [B] and attention for one new token per session (the eager step)."""
        rows, new_pos, new_slots, nb = self._decode_inputs(sessions)
        tables = self.pool.tables
        return new_pos, DecodeAttention(self.pool, new_slots, tables.table[rows, :nb], tables.lengths[rows])

    def _decode_inputs(self, sessions: list[InferenceSession]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """For one new token per session: their rows in `pool.tables` [B], positions [B], slots [B],
        and the blocks of the longest. Positions, slots, block tables and lengths come from the
        device mirror, indexed by the sessions' rows: only the new token ids travel from Python.
        Blocks are taken as the last one fills, and the lengths count the new token."""
        for s in sessions:
            s.make_room(1)  # a new block when the last one is full
        tables, bs = self.pool.tables, self.pool.block_size
        rows = self._index(tuple(s.row for s in sessions))  # [B]
        new_pos = tables.lengths[rows]  # [B]: tokens cached before this one
        new_slots = tables.table[rows, new_pos // bs] * bs + new_pos % bs  # [B]
        tables.lengths.index_add_(0, rows, torch.ones_like(rows))
        nb = -(-max(s.num_cached for s in sessions) // bs)  # blocks of the longest session
        return rows, new_pos, new_slots, nb

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
