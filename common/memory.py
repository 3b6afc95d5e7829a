"""Whether a KV pool (or a CUDA graph's buffers) fits the device, asked before a byte of it is allocated.

Why this exists: the pool is `torch.empty`, which on the CPU only reserves address space, so a
`num_kv_blocks` of a billion used to get as far as the allocator's bookkeeping (a Python list per
block) and die there with a RuntimeError or a MemoryError that named no knob. vLLM checks the KV
cache against the memory it may use and says which setting to change; so does this.
"""
from __future__ import annotations

import os

import torch

from common.config import ModelConfig

GiB = 1 << 30


def kv_bytes(config: ModelConfig, tokens: float, element_size: int) -> float:
    """The K and V of `tokens` tokens (a mean may be fractional), every layer and KV head, at
    `element_size` bytes a value: a KV block, a pool, what a decode step reads."""
    return 2 * config.num_layers * tokens * config.num_kv_heads * config.head_dim * element_size


def device_memory_bytes(device: torch.device) -> int:
    """What a pool on `device` may take at most: a GPU's free memory, counting what PyTorch holds
    cached but unused (an allocation reuses it first), or the host's physical memory (a pool
    larger than that could never be filled, even with nothing else running)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(nbytes: int, device: torch.device, what: str, knobs: str) -> None:
    """A ValueError saying `what` needs `nbytes` and which `knobs` to lower, if that is more than
    `device`'s memory (device_memory_bytes)."""
    have = device_memory_bytes(device)
    if nbytes > have:
        where = "free on the GPU" if device.type == "cuda" else f"of {device.type} memory"
        raise ValueError(f"{what} needs {nbytes / GiB:,.1f} GiB, more than the {have / GiB:,.1f} GiB {where}: "
                         f"lower {knobs}")


def check_kv_pool_fits(num_blocks: int, block_size: int, pool_bytes: int, device: torch.device) -> None:
    """A ValueError naming the knobs that size the pool if its `pool_bytes` (K and V, every layer,
    `num_blocks` blocks of `block_size` tokens as the caller asked) do not fit `device`'s memory."""
    check_fits(pool_bytes, device, f"the KV pool (num_kv_blocks={num_blocks}, block_size={block_size})",
               "num_kv_blocks, kv_cache_max_concurrency or block_size (or max_batch_size, which sizes the default pool)")
