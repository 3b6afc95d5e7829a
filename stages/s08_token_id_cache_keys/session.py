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
    timings: dict[str, float] = field(default_factory=dict)  # submitted, scheduled (perf_counter)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def worst_case_blocks(self, max_model_len: int) -> int:
        """Blocks this session needs if it runs to max_new_tokens (or the context window).

        Plus one: its last prompt block may be shared (prefix cache, in-batch duplicate), and
        then its first decode write takes a private copy of it (copy-on-write).
        """
        tokens = min(len(self.prompt_ids) + self.params.max_new_tokens, max_model_len)
        return -(-tokens // self.pool.block_size) + 1

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
        last = self.num_cached // bs
        if self.num_cached % bs and self.pool.allocator.ref_counts[self.block_table[last]] > 1:
            # Copy-on-write: the block we are about to write into is shared (prefix cache, or
            # another session): take a private copy so that nobody else's tokens change.
            private = self.pool.allocator.allocate()
            self.reserved -= 1
            self.pool.copy_block(self.block_table[last], private)
            self.pool.allocator.decref(self.block_table[last])
            self.block_table[last] = private
            self.pool.tables.set(self.row, last, [private])
        first_new = len(self.block_table)
        while len(self.block_table) * bs < self.num_cached + n:
            self.block_table.append(self.pool.allocator.allocate())
            self.reserved -= 1
        if len(self.block_table) > first_new:
            self.pool.zero_if_fresh(self.block_table[first_new:])
            self.pool.tables.set(self.row, first_new, self.block_table[first_new:])
        self.num_cached += n

    def attach_blocks(self, block_table: list[int], num_tokens: int) -> None:
        """Start from blocks someone else filled (shared: one more reference each, read-only)."""
        for block in block_table:
            self.pool.allocator.incref(block)
        self.block_table = list(block_table)
        self.num_cached = num_tokens
        if self.row is None:
            self.row = self.pool.tables.acquire()
        self.pool.tables.set(self.row, 0, self.block_table)
        self.pool.tables.lengths[self.row] = num_tokens

    def context_slots(self) -> torch.Tensor:
        """Slots of every cached token, in order: the block table read out."""
        bs = self.pool.block_size
        table = torch.tensor(self.block_table)
        return (table[:, None] * bs + torch.arange(bs)).flatten()[: self.num_cached]  # [num_cached]

    def release_kv_blocks(self) -> None:
        """Give every block (and any unused booking) back to the pool."""
        for block in self.block_table:
            self.pool.allocator.decref(block)
        self.pool.allocator.unreserve(self.reserved)
        self.block_table, self.reserved, self.num_cached = [], 0, 0
        if self.row is not None:
            self.pool.tables.release(self.row)
            self.row = None
