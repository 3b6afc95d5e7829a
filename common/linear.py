"""Projections with their weights packed once for oneDNN, on a CPU in fp32; `F.linear` elsewhere.

Why: most of a decode step's time is the model's projections, and on a CPU in fp32 `F.linear`
is MKL's sgemm, which lays the weight out again in its own blocked format on every call.
oneDNN's matmul with the weight reordered into its format ONCE, at load time, did the
decode-sized products about 2x faster on this 2-core AMD EPYC (Zen 4): SmolLM2's projections
for 16 one-token rows in 27 ms instead of 57. At prefill sizes (hundreds to thousands of rows)
the repacking is a small share of the call, and the two paths ran within about 15% of each
other, either way, in micro-benchmarks on different days. It is what
PyTorch's own compiler emits for a linear layer whose weight it may freeze
(`torch.ops.mkldnn._linear_pointwise`, Inductor's CPU freezing pass); we call the op directly,
no compiler and no extension: plain PyTorch.

The products are the same up to float rounding (summation order differs: a few 1e-6 on fp32
activations), which the parity tests against transformers check every stage against. The op
is private API, so `pack` checks it once against `F.linear` and everything falls back to
`F.linear` where it is missing or disagrees (and on CUDA, and in bf16/fp16, where `F.linear`
already is the fast path).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows the packed layout is tuned for; any number of rows works with it (decode: 1-64, prefill: thousands).
PACK_FOR_ROWS = 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`: x [..., in] @ weight [out, in]^T -> [..., out], through `packed`
    (the same weight as `pack` returned it) when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor | None:
    """`weight` [out, in] reordered once for oneDNN's matmul, or None where `F.linear` stays."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not _packing_works():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)


@functools.cache
def _packing_works() -> bool:
    """Is the op there, and does it give F.linear's products? Checked once per process."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
        x = torch.randn(2, 3, 40, generator=gen)
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
            return bool(torch.allclose(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False
