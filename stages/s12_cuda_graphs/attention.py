"""Paged attention in plain PyTorch.

Prefill: a prompt's uncached tokens (or a chunk of them) attend to its cached blocks and, causally, to
each other; their K/V are written into the sequence's blocks — for several prompts at once,
packed into one row. Decode: each sequence of the batch adds one token and attends over its
own cached tokens, read through its block table: its blocks are copied into a buffer that is
reused every layer and every step, padded to the longest sequence of the batch and masked
by length, and one attention call does the rest. A scheduler step runs both kinds in one forward (StepAttention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model import additive_mask, decode_attention

from .kv_cache import KVBlockPool


class PrefillAttention:
    """Several prompts in one forward, packed into one row `[1, S]`: each prompt's uncached tokens in turn.

    No padding: with a prefix cache one prompt may compute 500 tokens and the next 20, and a
    right-padded `[N, T]` batch would pay for the longest on every row. Per layer, every new
    K/V is written to its slot first; then each prompt attends on its own: it reads its blocks
    (the cached ones, and the ones just written) into the decode gather buffer, and its query
    at position start + t sees keys 0 .. start + t.

    GQA without copying K/V: the G query heads that share a KV head are stacked as G x n query
    rows of that head (`[1, Hkv, G * n, D]`), with the mask repeated G times. On the CPU this
    4-D call runs SDPA's fused kernel.

    A prompt with nothing cached (start 0) needs none of that: its keys are exactly the K/V
    this forward just computed, and "query t sees keys 0..t" is plain causal attention. So it
    attends over them in place, with `is_causal=True` and no mask: no gather of what was just
    written, and the kernel skips the key blocks above the diagonal (with the mask, a
    2,000-token prompt's prefill took a third longer on the CPU).
    """

    def __init__(self, pool: KVBlockPool, slots: torch.Tensor, spans: list[tuple[int, int, int]],
                 tables: list[list[int]], group: int) -> None:
        self.pool = pool
        self.slots = slots  # [S] where each new token's K/V go, prompt after prompt
        device, bs = slots.device, pool.block_size
        # Per prompt: (offset in the row, new tokens, block rows to gather, mask [G * n, start + n]);
        # a prompt with nothing cached: (offset, n, None, None), attended in place.
        self.parts: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for (offset, start, n), table in zip(spans, tables):
            if start == 0:
                self.parts.append((offset, n, None, None))
                continue
            length = start + n
            blocks = torch.tensor(table[: -(-length // bs)], device=device)  # [nb]
            keys = torch.arange(length, device=device)
            mask = keys[None, :] <= start + torch.arange(n, device=device)[:, None]  # [n, length]: causal from start
            self.parts.append((offset, n, pool.block_rows(blocks), additive_mask(mask.repeat(group, 1), pool.k[0].dtype)))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, S, Hq, D]; k, v: [1, S, Hkv, D]
        Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
        self.pool.write(layer_idx, self.slots, k[0], v[0])
        out = torch.empty_like(q[0])  # [S, Hq, D]
        for offset, n, rows, mask in self.parts:
            if rows is None:  # nothing cached: causal over this prompt's own new K/V
                span = slice(offset, offset + n)
                oi = F.scaled_dot_product_attention(
                    q[:, span].transpose(1, 2), k[:, span].transpose(1, 2), v[:, span].transpose(1, 2),
                    is_causal=True, enable_gqa=Hq != Hkv,
                )  # [1, Hq, n, D]
                out[span] = oi[0].transpose(0, 1)  # [n, Hq, D]
                continue
            qi = q[0, offset:offset + n].transpose(0, 1).reshape(1, Hkv, -1, D)  # [1, Hkv, G * n, D]
            keys, values = self.pool.gather_blocks(layer_idx, rows)  # [Hkv, nb, bs, D]
            length = mask.shape[1]
            ki, vi = keys.view(1, Hkv, -1, D)[:, :, :length], values.view(1, Hkv, -1, D)[:, :, :length]  # [1, Hkv, length, D]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)  # [1, Hkv, G * n, D]
            # reshape, not view: CUDA's SDPA kernels may hand back oi in a [1, G * n, Hkv, D] layout
            out[offset:offset + n] = oi.reshape(Hq, n, D).transpose(0, 1)  # [n, Hq, D]
        return out[None]  # [1, S, Hq, D]


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
                 lengths: torch.Tensor) -> None:
        self.pool = pool
        self.new_slots = new_slots  # [B]: where each sequence's new K/V go (a finished one has left the step)
        B, nb = blocks.shape
        self.rows = pool.block_rows(blocks.reshape(B * nb))  # [Hkv * B * nb]: the block tables, per head
        keys = torch.arange(nb * pool.block_size, device=lengths.device)
        self.mask = additive_mask((keys < lengths[:, None])[None, :, None, :], pool.k[0].dtype)  # [1, B, 1, nb * bs]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, 1, Hq, D]; k, v: [B, 1, Hkv, D]
        B, _, Hq, D = q.shape
        Hkv = k.shape[2]
        self.pool.write(layer_idx, self.new_slots, k[:, 0], v[:, 0])
        keys, values = self.pool.gather_blocks(layer_idx, self.rows)  # [Hkv, B * nb, bs, D]
        keys, values = keys.view(Hkv, B, -1, D), values.view(Hkv, B, -1, D)  # [Hkv, B, L, D]
        # GQA without copying K/V: the G query heads that share a KV head become G query rows.
        qh = q.view(B, Hkv, Hq // Hkv, D).transpose(0, 1)  # [Hkv, B, G, D]
        out = decode_attention(qh, keys, values, self.mask)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(B, 1, Hq, D)


class StepAttention:
    """One scheduler step in one packed row `[1, B + S]`: B decode tokens first, then S prompt-chunk tokens.

    The model runs every token of the step through the same matmuls (one pass over the
    weights), and only attention tells the two kinds apart: the decode rows go to
    `DecodeAttention` as a `[B, 1]` batch, the chunks to `PrefillAttention`, and their outputs
    are joined back in the same order.
    """

    def __init__(self, decode: DecodeAttention | None, prefill: PrefillAttention | None, num_decode: int) -> None:
        self.decode, self.prefill, self.num_decode = decode, prefill, num_decode

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, B + S, Hq, D]; k, v: [1, B + S, Hkv, D]
        B = self.num_decode
        parts = []
        if self.decode is not None:  # [B, 1, H, D]: each decode token is its own row
            parts.append(self.decode(layer_idx, q[0, :B, None], k[0, :B, None], v[0, :B, None]).transpose(0, 1))
        if self.prefill is not None:
            parts.append(self.prefill(layer_idx, q[:, B:], k[:, B:], v[:, B:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [1, B + S, Hq, D]
