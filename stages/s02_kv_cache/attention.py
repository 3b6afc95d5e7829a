"""Attention for stage 02: append this step's K/V to a contiguous cache, then attend over the cache.

The prefill writes the whole (left-padded) prompt at columns [0, T); each decode step
writes one column and attends over every column so far. The mask hides left padding
and the columns of rows that already finished.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model import additive_mask

from .kv_cache import ContiguousKVCache


def causal_padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask from a padding mask.

    valid: [B, T] True where the token is real (False = left padding).
    Returns [B, 1, T, T]: query t may attend key s when s <= t and s is real. A padding
    query may attend itself, so that no row of the softmax is empty (its output is ignored).
    """
    T = valid.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()  # [T, T]
    mask = causal[None, :, :] & valid[:, None, :]  # [B, T, T]
    mask |= torch.eye(T, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None, :, :]


class CachedAttention:
    """Writes K/V at columns [start, start + T) of the cache and attends over [0, start + T)."""

    def __init__(self, cache: ContiguousKVCache, start: int, mask: torch.Tensor) -> None:
        self.cache = cache
        self.start = start
        self.mask = additive_mask(mask, cache.k[0].dtype)  # [B, 1, T, start + T]: once per forward, not per layer

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]
        self.cache.write(layer_idx, self.start, k, v)
        B, T, Hq, D = q.shape
        Hkv, end = k.shape[2], self.start + T
        keys, values = self.cache.k[layer_idx][:, :, :end], self.cache.v[layer_idx][:, :, :end]  # [B, Hkv, end, D]
        if T == 1:
            # Decode, GQA without copying K/V: the G query heads that share a KV head become G
            # query rows of that head, [B, Hkv, G, D] (enable_gqa would expand K/V G times).
            out = F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, D), keys, values, attn_mask=self.mask)
            return out.reshape(B, 1, Hq, D)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=self.mask, enable_gqa=Hq != Hkv,
        )  # [B, Hq, T, D]
        return out.transpose(1, 2)  # [B, T, Hq, D]
