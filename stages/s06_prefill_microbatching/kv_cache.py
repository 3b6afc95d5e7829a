"""Paged KV memory: fixed-size blocks from one shared pool, handed out by a block allocator.

Stage 02 reserved `[B, longest prompt + max_new_tokens]` for every row of a batch. Here the
KV memory is one pool of `num_blocks` blocks of `block_size` tokens per layer; a sequence
owns a list of block ids (its *block table*) and takes a new block only when its last one
is full. Short sequences hold little memory, and freed blocks are reused at once.
"""

from __future__ import annotations

import torch

from common.config import ModelConfig


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


class KVBlockPool:
    """K and V for every layer: `[num_blocks, block_size, Hkv, D]` each, plus their allocator."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # torch.empty: a slot is always written before it is read, and blocks nobody has used yet
        # are never touched — so the OS does not even back them with memory.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.bytes_per_block = 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.allocator.num_blocks

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([N, Hkv, D]) at flat slots ([N]); slot = block_id * block_size + offset."""
        self.k[layer_idx].view(-1, *k.shape[1:])[slots] = k
        self.v[layer_idx].view(-1, *v.shape[1:])[slots] = v

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K, V at flat slots ([N]) -> [N, Hkv, D] each (index_select: plain row copies, fast)."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        return torch.index_select(k.view(-1, *k.shape[2:]), 0, slots), torch.index_select(v.view(-1, *v.shape[2:]), 0, slots)
