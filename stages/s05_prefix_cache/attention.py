"""Paged attention in plain PyTorch.

Prefill: a prompt's K/V are all new, so attention is ordinary causal attention over them;
they are also written into the sequence's blocks. Decode: each sequence of the batch adds
one token and attends over its own cached tokens, read through its block table. The batch
is *packed*, not padded: the keys of all sequences lie end to end (`[N, Hkv, D]`, N = the
sum of their lengths) and a segment id says which sequence each key belongs to, so a
64-token sequence next to a 2,000-token one costs 64 keys, not 2,000.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import KVBlockPool


class PrefillAttention:
    """One sequence's prompt: causal attention over its own K/V, which are saved to its blocks."""

    def __init__(self, pool: KVBlockPool, slots: torch.Tensor) -> None:
        self.pool = pool
        self.slots = slots  # [T] where each prompt token's K/V go

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D]
        self.pool.write(layer_idx, self.slots, k[0], v[0])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=q.shape[2] != k.shape[2],
        )  # [1, Hq, T, D]
        return out.transpose(1, 2)


class DecodeAttention:
    """A batch of sequences, one new token each, attending over their paged context."""

    def __init__(self, pool: KVBlockPool, new_slots: torch.Tensor, context_slots: torch.Tensor,
                 segments: torch.Tensor, writers: torch.Tensor | None = None) -> None:
        self.pool = pool
        self.new_slots = new_slots  # [W]: where each writing sequence's new K/V go
        self.context_slots = context_slots  # [N]: every sequence's slots end to end (new token included)
        self.segments = segments  # [N]: which sequence (0..B-1) each slot belongs to
        self.writers = writers  # [W]: rows that store their new K/V (None: all of them)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, 1, Hq, D]; k, v: [B, 1, Hkv, D]
        B, _, Hq, D = q.shape
        Hkv = k.shape[2]
        rows = slice(None) if self.writers is None else self.writers
        self.pool.write(layer_idx, self.new_slots, k[rows, 0], v[rows, 0])
        keys, values = self.pool.gather(layer_idx, self.context_slots)  # [N, Hkv, D]
        seg = self.segments
        qg = torch.index_select(q.view(B, Hkv, Hq // Hkv, D), 0, seg)  # [N, Hkv, G, D]: each key meets its sequence's query
        scores = torch.einsum("nhd,nhgd->nhg", keys, qg) * (1.0 / math.sqrt(D))  # [N, Hkv, G]
        # Softmax within each segment: subtract the segment's max, exponentiate, normalise.
        idx = seg[:, None, None].expand_as(scores)
        seg_max = torch.full((B, *scores.shape[1:]), -math.inf, dtype=scores.dtype, device=scores.device)
        seg_max.scatter_reduce_(0, idx, scores, reduce="amax", include_self=True)  # [B, Hkv, G]
        p = torch.exp(scores - torch.index_select(seg_max, 0, seg))  # [N, Hkv, G]
        denom = torch.zeros_like(seg_max).index_add_(0, seg, p)  # [B, Hkv, G]
        out = torch.zeros((B, *qg.shape[1:]), dtype=q.dtype, device=q.device)  # [B, Hkv, G, D]
        out.index_add_(0, seg, p[..., None] * values[:, :, None, :])
        out = out / denom[..., None]
        return out.reshape(B, 1, Hq, D)
