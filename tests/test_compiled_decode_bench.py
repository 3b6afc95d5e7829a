"""scripts/compiled_decode_bench.py: the compiled bucket forward computes what the eager one does,
its attention through the opaque op; and the summary's arithmetic."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import load_script

bench = load_script("compiled_decode_bench")


def test_same_tokens_counts_up_to_where_runs_part() -> None:
    assert bench.same_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert bench.same_tokens([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == 0.25  # what follows a parting counts as parted
    assert bench.same_tokens([[1, 2], [7, 8]], [[1, 2], [6, 8]]) == 0.5


def test_summarize_pairs_forms_per_batch() -> None:
    runs = [
        {"form": "eager", "batch": 4, "step_ms": 10.0, "floor_ms": 5.0, "compile_s": {}, "tokens": [[1, 2]]},
        {"form": "compiled", "batch": 4, "step_ms": 8.0, "floor_ms": None, "compile_s": {"4": 3.0}, "tokens": [[1, 2]]},
        {"form": "compiled", "batch": 4, "step_ms": 9.0, "floor_ms": None, "compile_s": {"4": 5.0}, "tokens": [[1, 3]]},
        {"form": "eager", "batch": 4, "step_ms": 12.0, "floor_ms": 6.0, "compile_s": {}, "tokens": [[1, 2]]},
    ]
    (row,) = bench.summarize(runs)
    assert row["eager_ms"] == 11.0 and row["compiled_ms"] == 8.5 and row["floor_ms"] == 5.5
    assert row["compiled_vs_eager"] == pytest.approx(8.5 / 11.0)
    assert row["ratio_per_round"] == [0.8, 0.75]  # each round's compiled over that round's eager
    assert row["compile_s"] == 4.0 and row["same_tokens"] == 1.0  # the first round's tokens
    assert row["exact_pack_floor_ms"] is None  # none measured (bf16, or no MKL)
    runs[0]["exact_pack_floor_ms"], runs[3]["exact_pack_floor_ms"] = 3.0, 4.0
    assert bench.summarize(runs)[0]["exact_pack_floor_ms"] == 3.5


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles C++ on a CPU: no compiler here")
def test_compiled_step_matches_eager_on_the_tiny_model() -> None:
    """Each form in a fresh process, as the bench runs them: the compiled steps' greedy tokens are
    the eager ones (fp32), every layer of every compiled step went through the opaque op, and the
    graph's compile was timed."""
    a = argparse.Namespace(stage="14", model="tiny", dtype="float32", steps=2, prompt_len=8, seed=0)
    eager, compiled = (bench.spawn(form, 2, a) for form in bench.FORMS)
    assert compiled["tokens"] == eager["tokens"]
    assert eager["attention_op_calls"] == 0 and eager["floor_ms"] > 0
    assert compiled["exact_pack_floor_ms"] is None  # timed by the eager process only
    assert eager["exact_pack_floor_ms"] is None or eager["exact_pack_floor_ms"] > 0  # None: no MKL in this torch
    layers = 2  # the tiny model's
    assert compiled["attention_op_calls"] >= layers * (2 + 4) and compiled["attention_op_calls"] % layers == 0
    assert compiled["compile_s"] and all(s > 0 for s in compiled["compile_s"].values())
    assert compiled["compiled_graphs"] >= 1 and eager["compiled_graphs"] == 0  # a fallback to eager compiles none


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="a torch without MKL")
def test_exact_pack_floor_times_the_plain_product_in_fp32_only() -> None:
    """What the fp32 floor times is F.linear's product (MKL's packed sgemm at the rows it was packed
    for, the plain one at any other), and bf16 gets no such floor."""
    from common.loader import load_model

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 40, generator=gen), torch.randn(4, 40, generator=gen)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 4)
    assert torch.allclose(torch.ops.mkl._mkl_linear(x, packed, w, None, 4), F.linear(x, w), atol=1e-5)
    assert torch.allclose(torch.ops.mkl._mkl_linear(x[:3], packed, w, None, 4), F.linear(x[:3], w), atol=1e-5)
    assert bench.exact_pack_floor_ms(load_model("tiny", device="cpu", dtype="bfloat16").model, 2) is None
    assert bench.exact_pack_floor_ms(load_model("tiny", device="cpu", dtype="float32").model, 2) > 0
