"""Paged KV memory: fixed-size blocks from one shared pool, handed out by a block allocator.

Stage 02 reserved `[B, longest prompt + max_new_tokens]` for every row of a batch. Here the
KV memory is one pool of `num_blocks` blocks of `block_size` tokens per layer; a sequence
owns a list of block ids (its *block table*) and takes a new block only when its last one
is full. Short sequences hold little memory, and freed blocks are reused at once.

The pool is laid out heads first, `[Hkv, num_blocks, block_size, D]`, so that one
`index_select` copies whole blocks of a batch's sequences into a reused buffer that *is* the
`[Hkv, B, L, D]` tensor attention wants: no per-step allocation, no reshuffling.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from common.config import ModelConfig
from common.device import to_device
from common.memory import check_kv_pool_fits, kv_bytes


class OutOfKVBlocks(RuntimeError):
    """The pool cannot hold this request right now (it may fit later, when others finish)."""


class BlockAllocator:
    """Free list and reference counts of block ids, and the cached blocks nobody holds.

    Ref counts let sequences share a block (the prefix cache); `reserve` books the blocks a
    prefill will write, so that an admitted prompt can never run out half-way; a decoding
    sequence takes its next block unbooked, from what no booking holds. A block whose
    last owner lets go goes back to one of two places: the plain free list, or — when the
    prefix cache knows its contents (`cached`) — an LRU of *evictable* blocks. Those still
    count as free, and a new request may take one back as a hit; `allocate` uses plain free
    blocks first and evicts the least recently used cached block only when there is no other.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: the last freed is reused first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref count 0; least recently freed first
        self.cached: set[int] = set()  # blocks whose K/V the prefix cache can hand out
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets an evicted block
        self.ref_counts = [0] * num_blocks
        self.reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Free blocks nobody has booked yet."""
        return self.num_free - self.reserved

    def reserve(self, n: int) -> None:
        if n > self.num_available:
            raise OutOfKVBlocks(f"need {n} KV blocks, {self.num_available} available of {self.num_blocks}")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def allocate(self, booked: bool = True) -> int:
        """Take one block: a plain free one, else evict the LRU cached one. A booked block was
        reserved earlier (a prefill's); an unbooked one (a decode's, taken as a sequence grows) may
        use only what no booking holds, and raises OutOfKVBlocks when there is none: then the
        scheduler preempts someone."""
        if booked and self.reserved <= 0:  # an allocation nobody booked would eat someone else's reservation
            raise RuntimeError("KV block allocated as booked without a reservation: the accounting is wrong")
        if not booked and self.num_available <= 0:
            raise OutOfKVBlocks(f"no KV block left: {self.num_free} free, all {self.reserved} of them booked")
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self.forget(block)
        self.reserved -= booked
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> bool:
        """One more owner of a cached block. True if it was evictable: taking it back out of the
        free blocks uses one of the caller's booked blocks, exactly as `allocate` would."""
        revived = self.ref_counts[block] == 0
        if revived:
            if self.reserved <= 0:
                raise RuntimeError("cached KV block reused without a reservation")
            del self._evictable[block]
            self.reserved -= 1
        self.ref_counts[block] += 1
        return revived

    def decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.cached:
                self._evictable[block] = None  # most recently freed: evicted last
            else:
                self._free.append(block)

    def forget(self, block: int) -> None:
        """The block's contents are no longer a cached prefix (evicted, or the cache was cleared)."""
        if block in self.cached:
            self.cached.discard(block)
            if self.on_evict is not None:
                self.on_evict(block)
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)


class BlockTables:
    """The live sessions' block tables and lengths on the device, one row per session.

    A session's Python list stays the allocator's record; this is its mirror for the kernels
    (vLLM calls it the persistent batch). It changes incrementally — one entry when a session
    takes a block, +1 on the lengths of the rows a decode step wrote — so a step reads what it
    needs with an index instead of rebuilding tensors from Python lists every step. Unused
    entries hold block 0: reading them is harmless, attention masks them out by length.
    """

    def __init__(self, max_blocks_per_seq: int, device: torch.device, rows: int = 8) -> None:
        self.table = torch.zeros((rows, max_blocks_per_seq), dtype=torch.long, device=device)  # [rows, max blocks]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]: tokens cached
        self._free_rows = list(range(rows - 1, -1, -1))

    def acquire(self) -> int:
        """A free row for a new session (the table doubles when every row is taken)."""
        if not self._free_rows:
            rows = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.lengths = torch.cat([self.lengths, torch.zeros_like(self.lengths)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def set(self, row: int, index: int, blocks: list[int]) -> None:
        """Entries [index, index + len(blocks)) of `row` now name these blocks."""
        self.table[row, index:index + len(blocks)] = to_device(blocks, torch.long, self.table.device)


class KVBlockPool:
    """K and V for every layer: `[Hkv, num_blocks + 1, block_size, D]` each, plus their allocator.

    The last block, `pad_block`, is no sequence's: the allocator hands out blocks 0 .. num_blocks - 1
    only. A CUDA graph's padded rows (cuda_graphs.py) write their K/V there and read it back,
    so padding a batch up to a captured size never touches a live block."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.pad_block = num_blocks
        shape = (config.num_kv_heads, num_blocks + 1, block_size, config.head_dim)
        self.bytes_per_block = kv_bytes(config, block_size, dtype.itemsize)
        check_kv_pool_fits(num_blocks, block_size, shape[1] * self.bytes_per_block, device)  # a ValueError naming the knobs
        # torch.empty: blocks nobody has used yet are never touched, so the OS does not even back
        # them with memory. A block is zeroed when it is first taken (see `zero_if_fresh`).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._fresh = [True] * (num_blocks + 1)  # never taken since the pool was made: uninitialised memory
        self.zero_if_fresh([0, self.pad_block])  # block 0 pads every block table (see BlockTables)
        self.tables = BlockTables(-(-config.max_position_embeddings // block_size), device)
        self._scratch = torch.empty(0, dtype=dtype, device=device)  # decode gather buffer, reused by every layer

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.allocator.num_blocks

    def zero_if_fresh(self, blocks: list[int]) -> None:
        """Zero blocks taken for the first time. Decode reads whole blocks, so the slots past a
        sequence's length are read too (and masked): uninitialised memory there may hold NaN bit
        patterns, and a masked NaN still poisons `softmax @ V` (0 * NaN = NaN)."""
        fresh = [b for b in blocks if self._fresh[b]]
        if fresh:
            index = to_device(fresh, torch.long, self.k[0].device)
            for t in self.k + self.v:
                t.index_fill_(1, index, 0.0)
            for b in fresh:
                self._fresh[b] = False

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([N, Hkv, D]) at flat slots ([N]); slot = block_id * block_size + offset."""
        for pool, new in ((self.k[layer_idx], k), (self.v[layer_idx], v)):
            pool.view(pool.shape[0], -1, pool.shape[-1]).index_copy_(1, slots, new.transpose(0, 1))

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K, V at flat slots ([N]) -> [N, Hkv, D] each (for tests and notebooks; decode uses gather_blocks)."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        return (torch.index_select(k.view(k.shape[0], -1, k.shape[-1]), 1, slots).transpose(0, 1),
                torch.index_select(v.view(v.shape[0], -1, v.shape[-1]), 1, slots).transpose(0, 1))

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Where `blocks` ([n] ids) lie in the `[Hkv * num_blocks, block_size * D]` view of a layer,
        head after head: [Hkv * n]. Made once per step; every layer gathers with it."""
        Hkv, num_blocks = self.k[0].shape[:2]
        heads = torch.arange(Hkv, device=blocks.device) * num_blocks  # [Hkv]
        return (heads[:, None] + blocks[None, :]).reshape(-1)  # [Hkv * n]

    def gather_blocks(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the blocks at `rows` (from `block_rows`) of one layer into the reused scratch buffer;
        returns K, V as `[Hkv, n, block_size, D]` views of it. One `index_select` over dim 0 each:
        whole rows of block_size * D values, the fast path, split across threads."""
        Hkv, num_blocks, bs, D = self.k[layer_idx].shape
        n = rows.shape[0] * bs * D
        if self._scratch.numel() < 2 * n:  # grows (by half again) as contexts grow; never shrinks
            self._scratch = torch.empty(3 * n, dtype=self._scratch.dtype, device=self._scratch.device)
        k_out, v_out = self._scratch[:n].view(-1, bs * D), self._scratch[n:2 * n].view(-1, bs * D)
        torch.index_select(self.k[layer_idx].view(Hkv * num_blocks, bs * D), 0, rows, out=k_out)
        torch.index_select(self.v[layer_idx].view(Hkv * num_blocks, bs * D), 0, rows, out=v_out)
        return k_out.view(Hkv, -1, bs, D), v_out.view(Hkv, -1, bs, D)
