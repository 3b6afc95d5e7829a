"""InferenceSession: one request's state between steps: its tokens, its sampling state, and the
KV blocks it owns (its block table).

The engine (engine.py) makes one per request and runs the forwards over them. A session takes
its blocks from the shared pool as its tokens need them and gives them back when it ends,
keeping its row of the pool's device block tables in step with its own list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.requests import Request, SamplingParams

from .kv_cache import KVBlockPool
from .prefix_cache import BlockKey


@dataclass
class InferenceSession:
    """One request's decoding state. It owns its KV blocks through `block_table`."""

    request: Request
    prompt_ids: list[int]
    truncated: bool
    generator: torch.Generator | None
    pool: KVBlockPool
    generated: list[int] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the blocks
    reserved: int = 0  # blocks booked for this session but not taken yet
    row: int | None = None  # its row in pool.tables, the device mirror of block_table (from its first block on)
    prefill_target: int = 0  # tokens to prefill before sampling: the prompt, or prompt + generated after a preemption
    preempted: bool = False  # waiting to be readmitted, holding no block
    preemptions: int = 0
    computed: int = 0  # the most tokens it ever had cached: below that, a prefill computes them again
    prompt_counted: bool = False  # its prompt is in the prefix cache's statistics (once, however often it comes back)
    block_keys: list[BlockKey] = field(default_factory=list)  # chained keys of the prompt's full blocks
    reused_blocks: int = 0  # prompt blocks taken from the prefix cache instead of computed
    timings: dict[str, float] = field(default_factory=dict)  # submitted, scheduled (perf_counter)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def prefill_ids(self) -> list[int]:
        """What the session prefills before it samples: its prompt, or after a preemption its
        prompt and every token it generated (recompute: their K/V were given back)."""
        return self.tokens[: self.prefill_target]

    @property
    def prefilling(self) -> bool:
        """Some of `prefill_ids` still have no K/V: the session gets chunks, not decode steps."""
        return not self.finished and not self.preempted and self.num_cached < self.prefill_target

    def needs_block(self) -> bool:
        """Its next decode token starts a new block (the last one is full)."""
        return len(self.block_table) * self.pool.block_size < self.num_cached + 1

    def take_slots(self, n: int) -> torch.Tensor:
        """Slots for the next n tokens (a prompt), taking new blocks from the pool as the last one fills."""
        start = self.num_cached
        self.make_room(n)
        self.pool.tables.lengths[self.row] = self.num_cached
        pos = torch.arange(start, start + n)
        return torch.tensor(self.block_table)[pos // self.pool.block_size] * self.pool.block_size + pos % self.pool.block_size  # [n]

    def make_room(self, n: int) -> None:
        """Count n more cached tokens, taking a block each time the last one is full (mirrored on the device)."""
        if self.row is None:
            self.row = self.pool.tables.acquire()
        bs = self.pool.block_size
        first_new = len(self.block_table)
        while len(self.block_table) * bs < self.num_cached + n:
            booked = self.reserved > 0  # a prefill's blocks were booked at admission; a decode's are taken now
            self.block_table.append(self.pool.allocator.allocate(booked))
            self.reserved -= booked
        if len(self.block_table) > first_new:
            self.pool.zero_if_fresh(self.block_table[first_new:])
            self.pool.tables.set(self.row, first_new, self.block_table[first_new:])
        self.num_cached += n

    def attach_blocks(self, blocks: list[int]) -> None:
        """Continue the prompt with full blocks someone else filled (shared: one more reference each, read-only)."""
        bs = self.pool.block_size
        assert self.num_cached == len(self.block_table) * bs, "cached blocks follow full blocks only"
        for block in blocks:
            if self.pool.allocator.share(block):
                self.reserved -= 1  # it was evictable: taking it back used one of our booked blocks
        if self.row is None:
            self.row = self.pool.tables.acquire()
        self.pool.tables.set(self.row, len(self.block_table), blocks)
        self.block_table += blocks
        self.reused_blocks += len(blocks)
        self.num_cached += len(blocks) * bs
        self.pool.tables.lengths[self.row] = self.num_cached

    def context_slots(self) -> torch.Tensor:
        """Slots of every cached token, in order: the block table read out."""
        bs = self.pool.block_size
        table = torch.tensor(self.block_table)
        return (table[:, None] * bs + torch.arange(bs)).flatten()[: self.num_cached]  # [num_cached]

    def release_kv_blocks(self) -> None:
        """Give every block (and any unused booking) back to the pool.

        Last block first: cached blocks become evictable in that order, so under pressure a
        prompt's tail is evicted before its head, which every longer match needs first.
        """
        for block in reversed(self.block_table):
            self.pool.allocator.decref(block)
        self.pool.allocator.unreserve(self.reserved)
        self.block_table, self.reserved, self.num_cached = [], 0, 0
        if self.row is not None:
            self.pool.tables.release(self.row)
            self.row = None
