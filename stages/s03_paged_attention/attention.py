"""Paged attention in plain PyTorch.

Prefill: a prompt's K/V are all new, so attention is ordinary causal attention over them;
they are also written into the sequence's blocks. Decode: each sequence of the batch adds
one token and attends over its own cached tokens, read through its block table: its blocks
are copied into a buffer that is reused every layer and every step, padded to the longest
sequence of the batch and masked by length, and one attention call does the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model import additive_mask, decode_attention

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
    """A batch of sequences, one new token each, attending over their paged context.

    Per layer: store the new K/V at their slots, copy every sequence's blocks into one reused
    buffer (`KVBlockPool.gather_blocks`: block tables padded to the longest, so the buffer is a
    `[Hkv, B, nb * block_size, D]` rectangle), then one attention call with a length mask
    (`decode_attention`: SDPA, or in bf16 on a CPU over a large rectangle its math in two
    matmuls). Everything
    that is the same for all layers — the flat block list, the mask — is built once per step (the
    mask as SDPA's additive one: given booleans, SDPA would convert them in every layer).
    """

    def __init__(self, pool: KVBlockPool, new_slots: torch.Tensor, blocks: torch.Tensor,
                 lengths: torch.Tensor, writers: torch.Tensor | None = None) -> None:
        self.pool = pool
        self.new_slots = new_slots  # [W]: where each writing sequence's new K/V go
        B, nb = blocks.shape
        self.rows = pool.block_rows(blocks.reshape(B * nb))  # [Hkv * B * nb]: the block tables, per head
        keys = torch.arange(nb * pool.block_size, device=lengths.device)
        self.mask = additive_mask((keys < lengths[:, None])[None, :, None, :], pool.k[0].dtype)  # [1, B, 1, nb * bs]
        self.writers = writers  # [W]: rows that store their new K/V (None: all of them)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, 1, Hq, D]; k, v: [B, 1, Hkv, D]
        B, _, Hq, D = q.shape
        Hkv = k.shape[2]
        rows = slice(None) if self.writers is None else self.writers
        self.pool.write(layer_idx, self.new_slots, k[rows, 0], v[rows, 0])
        keys, values = self.pool.gather_blocks(layer_idx, self.rows)  # [Hkv, B * nb, bs, D]
        keys, values = keys.view(Hkv, B, -1, D), values.view(Hkv, B, -1, D)  # [Hkv, B, L, D]
        # GQA without copying K/V: the G query heads that share a KV head become G query rows.
        qh = q.view(B, Hkv, Hq // Hkv, D).transpose(0, 1)  # [Hkv, B, G, D]
        out = decode_attention(qh, keys, values, self.mask)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(B, 1, Hq, D)
