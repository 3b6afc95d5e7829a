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

import torch

from common.config import ModelConfig
from common.device import to_device
from common.memory import check_kv_pool_fits, kv_bytes


class OutOfKVBlocks(RuntimeError):
    """The pool cannot hold this request right now (it may fit later, when others finish)."""


class BlockAllocator:
    """Free list and reference counts of block ids.

    Ref counts let later stages share a block between sequences (the prefix cache); a
    block returns to the free list when its last owner lets go. `reserve` books blocks a
    sequence may still need, so that admitted work can never run out half-way.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: the last freed is reused first
        self.ref_counts = [0] * num_blocks
        self.reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks nobody has booked yet."""
        return len(self._free) - self.reserved

    def reserve(self, n: int) -> None:
        if n > self.num_available:
            raise OutOfKVBlocks(f"need {n} KV blocks, {self.num_available} available of {self.num_blocks}")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def allocate(self) -> int:
        """Take one booked block (the caller reserved it earlier)."""
        if self.reserved <= 0:  # an allocation nobody booked would eat someone else's reservation
            raise RuntimeError("KV block allocated without a reservation: the worst-case accounting is wrong")
        block = self._free.pop()
        self.reserved -= 1
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
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
    """K and V for every layer: `[Hkv, num_blocks, block_size, D]` each, plus their allocator."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.bytes_per_block = kv_bytes(config, block_size, dtype.itemsize)
        check_kv_pool_fits(num_blocks, block_size, shape[1] * self.bytes_per_block, device)  # a ValueError naming the knobs
        # torch.empty: blocks nobody has used yet are never touched, so the OS does not even back
        # them with memory. A block is zeroed when it is first taken (see `zero_if_fresh`).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._fresh = [True] * num_blocks  # never taken since the pool was made: uninitialised memory
        self.zero_if_fresh([0])  # block 0 pads every block table (see BlockTables)
        self.tables = BlockTables(-(-config.max_position_embeddings // block_size), device)
        self._scratch = torch.empty(0, dtype=dtype, device=device)  # decode gather buffer, reused by every layer

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.allocator.num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block)."""
        for k, v in zip(self.k, self.v):
            k[:, dst] = k[:, src]
            v[:, dst] = v[:, src]
        self._fresh[dst] = False

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
