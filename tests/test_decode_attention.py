"""`common.model.decode_attention`: SDPA, or in bf16 on a CPU over a large K/V rectangle the same
math written out (two batched matmuls around a softmax), which ran in half SDPA's time on a Zen 4.
How large depends on the CPU (`DECODE_MATMUL_MIN_KEYS`: 32,768 rows x keys with AMX, never on an
Intel CPU without AMX, 1,024 on AMD's and other CPUs), so each test sets the threshold it exercises
and runs the same on any kind of CPU.

fp32 must not change at all (its tokens are transformers', bit for bit), nor bf16 below the
threshold; above it the output is SDPA's up to bf16 rounding, as transformers' own eager bf16
attention is. The engines' tokens on that path are checked in tests/test_bf16.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from common import model
from common.model import additive_mask, decode_attention


def _inputs(rows: int, keys: int, dtype: torch.dtype, seed: int = 0):
    """q [Hkv, B, G, D], K/V [Hkv, B, L, D] and a length mask: row b sees its first 1..L keys."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, rows, n, 64, generator=g).to(dtype) for n in (3, keys, keys))
    lengths = torch.randint(1, keys + 1, (rows,), generator=g)
    mask = additive_mask((torch.arange(keys) < lengths[:, None])[None, :, None, :], dtype)  # [1, B, 1, L]
    return q, k, v, mask


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype,rows,keys,threshold", [
    (torch.float32, 64, 80, 1024), (torch.float32, 2, 10, 1024), (torch.bfloat16, 2, 10, 1024),
    (torch.bfloat16, 8, 80, 1024), (torch.bfloat16, 64, 320, 32768)])  # the last: AMX's threshold
def test_fp32_and_small_bf16_rectangles_are_sdpa_bit_for_bit(monkeypatch, dtype, rows, keys, threshold) -> None:
    monkeypatch.setattr(model, "DECODE_MATMUL_MIN_KEYS", threshold)
    assert dtype == torch.float32 or rows * keys < model.DECODE_MATMUL_MIN_KEYS
    q, k, v, mask = _inputs(rows, keys, dtype)
    assert torch.equal(decode_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert "aten::scaled_dot_product_attention" in _ops(lambda: decode_attention(q, k, v, mask))


@pytest.mark.parametrize("rows,keys,threshold", [(16, 64, 1024), (64, 80, 1024), (5, 300, 1024), (64, 512, 32768)])
def test_a_large_bf16_rectangle_is_written_out_and_agrees_up_to_rounding(monkeypatch, rows, keys, threshold) -> None:
    monkeypatch.setattr(model, "DECODE_MATMUL_MIN_KEYS", threshold)
    assert rows * keys >= model.DECODE_MATMUL_MIN_KEYS
    q, k, v, mask = _inputs(rows, keys, torch.bfloat16, seed=rows)
    out = decode_attention(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ops = _ops(lambda: decode_attention(q, k, v, mask))
    assert "aten::scaled_dot_product_attention" not in ops and "aten::bmm" in ops
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
    # bf16 keeps 8 significant bits: both forms sit within a few of its steps of the exact output,
    # and the written-out one about as far as SDPA's own bf16 kernel
    assert (out.float() - exact).abs().max() < 0.05
    assert (out.float() - exact).abs().mean() < 2 * (sdpa - exact).abs().mean() + 1e-3


def test_a_masked_key_gets_no_weight_on_the_written_out_path(monkeypatch) -> None:
    """The mask is what keeps a row off the padding of the rectangle (other rows' lengths)."""
    monkeypatch.setattr(model, "DECODE_MATMUL_MIN_KEYS", 1024)
    q, k, v, _ = _inputs(32, 64, torch.bfloat16)
    lengths = torch.full((32,), 64)
    lengths[0] = 20  # row 0 is the short one; the rectangle is as wide as the others
    mask = additive_mask((torch.arange(64) < lengths[:, None])[None, :, None, :], torch.bfloat16)
    poisoned = v.clone()
    poisoned[:, 0, 20:] = 1e4  # what row 0 must never read
    assert torch.equal(decode_attention(q, k, poisoned, mask)[:, 0], decode_attention(q, k, v, mask)[:, 0])


def test_the_micro_benchmark_writes_both_forms_for_every_shape(tmp_path) -> None:
    """scripts/decode_attention_bench.py, whose result the threshold and the docs cite."""
    import json

    from conftest import load_script

    bench = load_script("decode_attention_bench")
    out = tmp_path / "bench.json"
    assert bench.main(["--rounds", "2", "--min-time-s", "0.001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["rows"], r["keys"]) for r in result["shapes"]] == bench.SHAPES
    for r in result["shapes"]:
        assert r["sdpa_ms"] > 0 and r["written_out_ms"] > 0
        assert r["written_out_vs_sdpa"] == pytest.approx(r["written_out_ms"] / r["sdpa_ms"])
        assert len(r["samples_ms"]["sdpa"]) == len(r["samples_ms"]["written_out"]) == 2
    assert result["dtype"] == "bfloat16" and result["command"].startswith("python scripts/decode_attention_bench.py")
    assert "cpu_capability" in result["env"]  # where it ran (commit, versions, CPU), as every result says


@pytest.mark.parametrize(("amx", "vendor", "expected"), [
    (True, "GenuineIntel", 32768), (False, "GenuineIntel", math.inf), (False, "AuthenticAMD", 1024), (False, "", 1024)])
def test_the_threshold_is_the_cpus(monkeypatch, amx, vendor, expected) -> None:
    """AMX: written out from 32,768; an Intel CPU without AMX: never (SDPA was the faster at every
    shape measured there); AMD's, and any other: from 1,024."""
    monkeypatch.setattr(model, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(model, "cpu_vendor", lambda: vendor)
    assert model.decode_matmul_min_keys() == expected


def test_never_means_sdpa_at_any_size(monkeypatch) -> None:
    monkeypatch.setattr(model, "DECODE_MATMUL_MIN_KEYS", math.inf)
    q, k, v, mask = _inputs(64, 2048, torch.bfloat16)
    assert torch.equal(decode_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
