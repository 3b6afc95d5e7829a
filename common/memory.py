"""Whether a KV pool fits the device, asked before a byte of it is allocated.

Why this exists: the pool is `torch.empty`, which on the CPU only reserves address space, so a
`num_kv_blocks` of a billion used to get as far as the allocator's bookkeeping (a Python list per
block) and die there with a RuntimeError or a MemoryError that named no knob. vLLM checks the KV
cache against the memory it may use and says which setting to change; so does this.
"""
from __future__ import annotations

import os

import torch

GiB = 1 << 30


def device_memory_bytes(device: torch.device) -> int:
    """What a pool on `device` may take at most: a GPU's free memory, or the host's physical memory
    (a pool larger than that could never be filled, even with nothing else running)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_kv_pool_fits(num_blocks: int, block_size: int, bytes_per_block: int, device: torch.device) -> None:
    """A ValueError naming the knobs that size the pool, if `num_blocks` blocks of `bytes_per_block`
    (K and V, every layer) would not fit in `device`'s memory."""
    need, have = num_blocks * bytes_per_block, device_memory_bytes(device)
    if need > have:
        raise ValueError(f"the KV pool (num_kv_blocks={num_blocks}, block_size={block_size}) needs {need / GiB:,.1f} GiB, "
                         f"more than the {have / GiB:,.1f} GiB of {device.type} memory: "
                         "lower num_kv_blocks, kv_cache_max_concurrency or block_size")
