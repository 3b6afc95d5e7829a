"""Projections through packed oneDNN weights (common/linear.py) give F.linear's products.

Why: on a CPU in fp32 every projection of every stage goes through the packed weight, so a
wrong layout, a dropped bias or a shape it mishandles would break every stage at once; and
where packing is not used (bf16, CUDA, an op that is missing) `F.linear` must take over.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import linear as lin
from common.loader import load_model


def _onednn_packed_linear_available() -> bool:
    """Does this torch build have oneDNN's packed linear at all? Asked of the platform, not of
    common.linear (whose own check compares its results: a broken packed path must fail the tests
    below, not skip them): the ops exist and run on a trivial input, whatever they return."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), 1)
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


ONEDNN = _onednn_packed_linear_available()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
def test_common_linear_uses_the_packed_path_where_the_platform_has_it() -> None:
    # _packing_works() also compares linear() with F.linear: False here means packed products are wrong.
    assert lin._packing_works()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("shape", [(1, 40), (16, 40), (3, 7, 40), (2048, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_projection_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(*shape, generator=gen)
    packed = lin.pack(w)
    assert packed is not None
    out = lin.linear(x, w, b, packed)
    assert out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice, as a split of a fused projection gives)
    wide = torch.randn(5, 80, generator=gen)
    torch.testing.assert_close(lin.linear(wide[:, :40], w, b, packed), F.linear(wide[:, :40], w, b),
                               rtol=1e-5, atol=1e-5)


def test_fp32_weights_are_packed_and_bf16_ones_only_on_bf16_units(monkeypatch) -> None:
    w = torch.randn(8, 4)
    assert lin.pack(w.half()) is None
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: False)  # bf16 emulated: F.linear stays
    assert lin.pack(w.to(torch.bfloat16)) is None
    x = torch.randn(2, 4)
    assert torch.equal(lin.linear(x, w, None, None), F.linear(x, w))  # no packed weight: plain F.linear
    monkeypatch.setattr(lin, "_packing_works", lambda dtype=torch.float32: False)  # a torch without the op
    assert lin.pack(w) is None
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: True)
    assert lin.pack(w.to(torch.bfloat16)) is None  # units, but no op that agrees: still F.linear


@pytest.mark.skipif(not ONEDNN or not lin.cpu_has_bf16_units() or not lin._packing_works(torch.bfloat16),
                    reason="this CPU or torch has no bf16 packed linear")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_packed_bf16_projection_equals_f_linear_to_bf16_rounding(rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 40, generator=gen).to(torch.bfloat16)
    packed = lin.pack(w)
    assert packed is not None
    torch.testing.assert_close(lin.linear(x, w, None, packed).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("units", [False, True])
def test_the_model_packs_every_projection_in_fp32_and_in_bf16_on_bf16_units(monkeypatch, units: bool) -> None:
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: units)
    fp32 = load_model("tiny", device="cpu", dtype="float32").model
    bf16 = load_model("tiny", device="cpu", dtype="bfloat16").model
    if ONEDNN:
        assert all(set(layer.packed) == set(layer.PROJECTIONS) for layer in fp32.layers)
        assert fp32.lm_head_packed is not None
    if units and ONEDNN and lin._packing_works(torch.bfloat16):
        assert all(set(layer.packed) == set(layer.PROJECTIONS) for layer in bf16.layers)
        assert bf16.lm_head_packed is not None and bf16.lm_head_packed.dtype == torch.bfloat16
    else:
        assert all(not layer.packed for layer in bf16.layers) and bf16.lm_head_packed is None
