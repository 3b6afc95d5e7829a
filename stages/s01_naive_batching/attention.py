"""Attention for stage 01: no cache at all.

Every forward pass sees the whole (left-padded) sequence, so attention is plain causal
self-attention over the tokens of this call, with padding masked out. Nothing is kept
between steps — which is exactly the waste that stage 02's KV cache removes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model import additive_mask


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


class DenseAttention:
    """Causal attention over exactly the tokens passed in; keeps no state between calls."""

    def __init__(self, mask: torch.Tensor, dtype: torch.dtype) -> None:
        self.mask = additive_mask(mask, dtype)  # [B, 1, T, T]: once per forward, not in every layer's SDPA

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]  ->  SDPA wants heads before time.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=q.shape[2] != k.shape[2],
        )  # [B, Hq, T, D]
        return out.transpose(1, 2)  # [B, T, Hq, D]
