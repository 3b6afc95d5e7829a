"""InferenceEngine for stage 14: one model split across ranks, tensor parallel.

`tensor_parallel_size` (vLLM's name) ranks each hold a 1/N share of every layer (parallel.py:
heads and the MLP's inner width, Megatron-style, one all-reduce after the attention and one
after the MLP) and a KV pool for their own KV heads. The scheduler runs on rank 0 only: every
step it builds a `Step`, what the forward needs (token ids, positions, slots, block tables,
lengths), sends it to the other ranks, and every rank runs the same forward on its share; the
LM head's slices are gathered, and rank 0 samples. Launched as one process, the engine starts
the other ranks itself; under torchrun every rank runs the same command, and the engine of a
rank other than 0 follows rank 0's steps inside its constructor and ends the process at close.
At size 1 this is stage 13, with no process group.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from common.device import to_device
from common.loader import LoadedModel
from common.memory import check_kv_pool_fits, kv_bytes
from common.requests import Completion, PreparedPrompt, Request, finish_reason_for, int_knob, prepare_prompt
from common.sampling import make_generator, sample_tokens

from .attention import DecodeAttention, PrefillAttention, StepAttention
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVBlockPool, OutOfKVBlocks
from .parallel import Step, TensorParallel
from .sharding import load_shard, local_config
from .prefix_cache import BlockKey, PrefixCache, block_keys
from .session import InferenceSession


CLOSE_WAIT_S = 10.0  # close() waits this long for a running step before it stops the ranks under it
DEFAULT_TOKENS_PER_SLOT = 1024  # default KV pool: this many tokens per decode slot (see _num_blocks)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # tokens per step on this CPU: decode rows + a prompt chunk (see BENCH)


class InferenceEngine:
    """Generates completions for a list of requests, `max_batch_size` at a time, KV in paged blocks."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 8, block_size: int = 16,
                 kv_cache_max_concurrency: int | None = None, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 enforce_eager: bool | None = None, max_cudagraph_capture_size: int | None = None,
                 tensor_parallel_size: int = 1) -> None:
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
        self.tp = TensorParallel(tensor_parallel_size, loaded.config, loaded.device)  # ValueError if it cannot split
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = loaded.config.max_position_embeddings
        self.group = loaded.config.num_heads // loaded.config.num_kv_heads  # query heads per KV head
        self.eos_token_ids = loaded.config.eos_token_ids
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or (0,))[0])
        num_blocks = self._num_blocks(block_size, kv_cache_max_concurrency, num_kv_blocks)
        if self.device.type == "cpu":  # the ranks' shares of the pool all live on this host: the whole must fit
            check_kv_pool_fits(num_blocks, block_size, kv_bytes(loaded.config, (num_blocks + 1) * block_size, loaded.dtype.itemsize),
                               self.device)
        self.tp.start({"package": __package__, "model": str(loaded.path), "device": self.device.type,
                       "dtype": str(loaded.dtype).replace("torch.", ""),
                       "kwargs": dict(max_batch_size=max_batch_size, block_size=block_size, num_kv_blocks=num_blocks,
                                      enable_prefix_caching=enable_prefix_caching,
                                      max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                                      max_cudagraph_capture_size=max_cudagraph_capture_size,
                                      tensor_parallel_size=tensor_parallel_size)})
        try:
            self._build(loaded, num_blocks, block_size, enable_prefix_caching, enforce_eager, capture_size)
        except BaseException:  # the other ranks may be waiting in a collective for this one: stop them
            self.tp.abort("tensor parallel: the engine failed to start")
            self.tp.close()
            raise
        if self.tp.rank != 0:  # a follower: it runs rank 0's steps until rank 0 closes, then its process ends
            for t in self.pool.k + self.pool.v:
                t.zero_()  # blocks are taken on rank 0: here every one starts at zero (see zero_if_fresh)
            self.tp.follow(lambda step: self._execute(step, self.graphs))

    def _build(self, loaded: LoadedModel, num_blocks: int, block_size: int, enable_prefix_caching: bool,
               enforce_eager: bool | None, capture_size: int) -> None:
        """This rank's share of the model, its KV pool and cache, and its decode graphs."""
        if self.tp.size > 1:  # every rank reads its own share of the checkpoint (sharding.py)
            self.model = load_shard(self.tp, loaded.path, loaded.config, self.device, loaded.dtype)
        else:
            self.model = loaded.model
        self.pool = KVBlockPool(local_config(loaded.config, self.tp.size), num_blocks, int(block_size),
                                loaded.dtype, self.device)  # the K/V of this rank's KV heads
        self.prefix_cache = PrefixCache(self.pool, enable_prefix_caching)
        self._peak_blocks = 0
        self.graph_steps = self.eager_steps = 0  # steps run through the decode graphs, and the rest
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # see _index
        self.num_preemptions = 0  # sessions preempted, and the tokens their readmissions computed again
        self.recomputed_tokens = 0
        self._steps, self._usage_sum, self._batch_sum, self._batch_peak = 0, 0.0, 0, 0
        self._waiting_steps, self._waiting_usage_sum = 0, 0.0
        self._step_lock = threading.Lock()  # held while a step runs: close() must not start a collective beside it
        # Graphs save kernel launches, which only a GPU has: on a CPU the buckets' padding would be
        # all cost, so the default there is eager, as in vLLM's CPU backend. enforce_eager=False
        # runs the padded path on a CPU anyway (the tests do: every line but the capture and replay).
        if enforce_eager is None:
            enforce_eager = self.device.type != "cuda"
        # Captured now, once, after the pool exists (the graphs read its block tables and blocks).
        self.graphs = None if enforce_eager else DecodeGraphs(self, capture_size)

    def close(self) -> None:
        """Give the graphs and their memory pool back (the engine still runs, eagerly), and end
        the other ranks of a tensor-parallel engine (it does not run after that).

        Both wait for a running step: a graph freed under its replay, or a collective started
        beside it, would break it. A step that outlasts CLOSE_WAIT_S keeps its graphs (they go
        with the engine) and has its ranks stopped under it."""
        if self._step_lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                if self.graphs is not None:
                    self.graphs.close()
                    self.graphs = None
                self.tp.close()
            finally:
                self._step_lock.release()
        else:  # a step is still running in another thread: stop the ranks under it, without a collective
            self.tp.abort("tensor parallel: the engine was closed during a step")
            self.tp.close()

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
            "num_preemptions": self.num_preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_usage_mean": self._usage_sum / self._steps if self._steps else 0.0,
            "kv_usage_peak": self._peak_blocks / self.pool.allocator.num_blocks,
            "kv_usage_mean_while_waiting": (self._waiting_usage_sum / self._waiting_steps
                                            if self._waiting_steps else None),
            "steps_while_waiting": self._waiting_steps,
            "running_mean": self._batch_sum / self._steps if self._steps else 0.0,
            "running_peak": self._batch_peak,
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
        try:
            while waiting or scheduler.has_unfinished():
                # Admit while a decode slot and the request's KV blocks are free: it joins the next step.
                while waiting and scheduler.num_unfinished < self.max_batch_size:
                    try:
                        rid = scheduler.add_session(sessions[waiting[0]], submitted=submitted)
                    except OutOfKVBlocks:
                        if not scheduler.has_unfinished():  # nothing holds a block, and it still does not fit
                            raise
                        break  # waits until a running request finishes and frees blocks
                    index_of[rid] = waiting.popleft()
                scheduler.step()
                for error in scheduler.pop_failed().values():
                    raise error  # a request that outgrew the whole pool: it could never finish
                for rid in scheduler.pop_finished_ids():
                    completions[index_of[rid]] = scheduler.pop_completion(rid)
        finally:  # on an error, the others' blocks go back too: the engine serves the next call whole
            for rid in scheduler.request_ids():
                scheduler.discard_request(rid)
        return completions  # type: ignore[return-value]

    def new_session(self, request: Request, prompt: PreparedPrompt) -> InferenceSession:
        """A session for a validated, tokenized request; fails if its prompt (and the first token
        it generates, when another follows: the last token's K/V is never written) could never fit
        in the pool, even alone. How long it may grow is not asked any more: a session that
        outgrows the whole pool is ended then (scheduler.py)."""
        session = InferenceSession(request, prompt.token_ids, prompt.truncated,
                                   make_generator(request.params, self.device), self.pool,
                                   prefill_target=len(prompt.token_ids))
        need = self.blocks_for(len(prompt.token_ids) + (request.params.max_new_tokens > 1))
        if need > self.pool.allocator.num_blocks:
            raise ValueError(f"prompt: a request's prompt needs {need} KV blocks but the pool has only "
                             f"{self.pool.allocator.num_blocks}; raise kv_cache_max_concurrency or num_kv_blocks")
        return session

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def reserve(self, session: InferenceSession, headroom: int = 0) -> None:
        """Take the session's cached prefix blocks and book the blocks of the rest of its
        `prefill_ids` (raises OutOfKVBlocks, leaving nothing behind, if they do not fit now).

        Only what the prefill will write is booked, not the tokens the session may generate: those
        take a block each time the last one fills. `headroom` more blocks must stay free after
        the booking (the scheduler asks for one per running session: admitting a request must
        not force a preemption at the very next step). Cached blocks nobody holds count as free,
        so a hit on one of those needs a booking too: taking it back out of the free blocks is an
        allocation like any other.
        """
        session.block_keys = block_keys(session.prefill_ids, self.pool.block_size)
        hits = self.prefix_cache.match(session.prefill_ids, session.block_keys)
        revived = sum(self.pool.allocator.ref_counts[b] == 0 for b in hits)
        need = self.blocks_for(session.prefill_target) - len(hits) + revived
        alloc = self.pool.allocator
        if need + headroom > alloc.num_available:
            raise OutOfKVBlocks(f"need {need} KV blocks and {headroom} spare, {alloc.num_available} available "
                                f"of {alloc.num_blocks}")
        alloc.reserve(need)
        session.reserved = need
        session.attach_blocks(hits)  # pinned now: nothing this burst allocates can evict them

    def preempt(self, session: InferenceSession) -> None:
        """Give a running session's blocks back and keep its tokens, to prefill them again later.

        Its full blocks go into the prefix cache first: freed, they stay evictable, and if nobody
        needs them before the session is readmitted, its recompute takes them back instead of
        computing them (vLLM's recompute preemption, with its prefix cache, does the same)."""
        bs = self.pool.block_size
        # Preempted in its first prefill, a prompt's hits are what it reused so far, not the blocks
        # of its own that its readmission will take back.
        self._count_prompt(session)
        full = session.num_cached // bs * bs
        known = session.tokens[:full]
        self.prefix_cache.insert(known, block_keys(known, bs), session.block_table)
        session.computed = max(session.computed, session.num_cached)
        session.release_kv_blocks()
        session.prefill_target = len(session.tokens)  # prompt + generated, then sample the next token
        session.preempted = True
        session.preemptions += 1
        self.num_preemptions += 1

    def _count_prompt(self, session: InferenceSession) -> None:
        """A prompt's prefix-cache statistics, once, however often it is prefilled again."""
        if not session.prompt_counted:
            session.prompt_counted = True
            self.prefix_cache.count(len(session.prompt_ids), session.reused_blocks)

    def step_sessions(self, decode: list[InferenceSession], prefilling: list[InferenceSession],
                      waiting: bool = False) -> tuple[torch.Tensor, list[InferenceSession]]:
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
                more = self.prefix_cache.match(s.prefill_ids, s.block_keys, pending)[len(s.block_table):]
                if more:
                    s.attach_blocks(more)
            start = s.num_cached
            n = min(s.prefill_target - start, budget)
            budget -= n
            self.recomputed_tokens += max(0, min(start + n, s.computed) - start)  # computed before a preemption
            slots.append(s.take_slots(n))
            chunks.append((s, start))
            for i in range(start // bs, (start + n) // bs):  # the full blocks this chunk completes
                pending.setdefault(s.block_keys[i], s.block_table[i])
        logits = self._step_forward(decode, chunks, slots)
        done = [s for s, _ in chunks if s.num_cached == s.prefill_target]
        for s, _ in chunks:  # only now: their K/V exist (a failed forward leaves nothing cached)
            self.prefix_cache.insert(s.prefill_ids, s.block_keys[: s.num_cached // bs], s.block_table)
        for s in done:
            s.pool.allocator.unreserve(s.reserved)  # its prefill is done: cached blocks others held left some booked
            s.reserved = 0
            self._count_prompt(s)
        self._record_step(len(decode) + len(chunks), waiting)
        return logits, done

    def _record_step(self, running: int, waiting: bool) -> None:
        """What the pool and the batch held this step, for kv_stats' means and peaks; `waiting`:
        a request was kept out for want of blocks (the steps where a full pool is the point)."""
        alloc = self.pool.allocator
        in_use = alloc.num_blocks - alloc.num_free
        self._steps += 1
        self._usage_sum += in_use / alloc.num_blocks
        self._waiting_steps += waiting
        self._waiting_usage_sum += waiting * in_use / alloc.num_blocks
        self._batch_sum += running
        self._batch_peak = max(self._batch_peak, running)
        self._peak_blocks = max(self._peak_blocks, in_use)

    def _step_forward(self, decode: list[InferenceSession], chunks: list[tuple[InferenceSession, int]],
                      slots: list[torch.Tensor]) -> torch.Tensor:
        """Decode tokens, then each chunk's prompt tokens, packed into one row `[1, B + sum n]`; logits [B + M, V].
        The chunks' blocks and `slots` ([sum n]) are taken already. The step is sent to the other
        ranks first (tensor parallel), then run here."""
        B = len(decode)
        ids: list[int] = [s.generated[-1] for s in decode]
        step = Step(ids, torch.empty(0, dtype=torch.long, device=self.device), list(range(B)), B)
        if decode:
            rows, new_pos, new_slots, nb = self._decode_inputs(decode)
            tables = self.pool.tables
            step.decode, step.positions = (new_slots, tables.table[rows, :nb], tables.lengths[rows]), new_pos
        if chunks:
            spans, positions = [], []  # the prompt tokens' positions; the decode rows' came from the device mirror
            for s, start in chunks:
                n = s.num_cached - start
                spans.append((len(ids) - B, start, n))  # (offset among the prompt tokens, first position, tokens)
                ids += s.prefill_ids[start:start + n]
                positions.extend(range(start, start + n))
                if s.num_cached == s.prefill_target:
                    step.rows.append(len(ids) - 1)  # the prompt's last token: sample its first output token
            step.prefill = (torch.cat(slots), spans, [s.block_table for s, _ in chunks])
            step.positions = torch.cat([step.positions, to_device(positions, torch.long, self.device)])  # [B + sum n]
        with self._step_lock:
            graphs = self.graphs  # read under the lock: close() drops them only between steps
            step.graph = bool(decode) and not chunks and graphs is not None and graphs.fits(B)
            if step.graph:
                self.graph_steps += 1
            else:
                self.eager_steps += 1
            return self.tp.lead(step, lambda: self._execute(step, graphs))  # [B + M, V]

    def _execute(self, step: Step, graphs: DecodeGraphs | None) -> torch.Tensor:
        """Run one step's forward on this rank's share of the model and KV pool; logits [rows, V]
        (on a rank other than 0, its slice of the vocabulary)."""
        dev = self.device
        decode = None if step.decode is None else tuple(t.to(dev) for t in step.decode)
        if step.graph:  # decode only: a replay (on a CPU with enforce_eager=False, the same padded function, eagerly)
            return graphs.run(step.ids, step.positions.to(dev), *decode)  # [B, V]
        prefill_attention = None
        if step.prefill is not None:
            slots, spans, tables = step.prefill
            prefill_attention = PrefillAttention(self.pool, slots.to(dev), spans, tables, self.group)
        attention = StepAttention(None if decode is None else DecodeAttention(self.pool, *decode), prefill_attention,
                                  step.num_decode)
        ids = to_device([step.ids], torch.long, dev)  # [1, B + sum n]
        return self.model(ids, step.positions.to(dev)[None], attention, logits_indices=to_device(step.rows, torch.long, dev))

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
