"""A contiguous KV cache: one rectangle per layer, sized for the batch's worst case.

Every row reserves room for the longest prompt in its batch plus the largest
`max_new_tokens` — whether it needs it or not. That padding waste is what stage 03's
paged blocks remove.
"""

from __future__ import annotations

import torch

from common.config import ModelConfig


class ContiguousKVCache:
    """K and V for one static batch: per layer `[B, Hkv, capacity, D]` (heads first, as SDPA reads them)."""

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch_size, config.num_kv_heads, capacity, config.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        """Bytes reserved, used or not."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's k, v ([B, T, Hkv, D]) at columns [start, start + T)."""
        end = start + k.shape[1]
        self.k[layer_idx][:, :, start:end] = k.transpose(1, 2)
        self.v[layer_idx][:, :, start:end] = v.transpose(1, 2)
