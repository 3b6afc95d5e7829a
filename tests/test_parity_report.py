"""`stagewise parity` (common/bench/parity.py): the measured counterpart of tests/test_parity.py.

What it must get right: where two token lists first differ, the reference's margin there, and an
fp32 run on `tiny` that reports every stage identical (the tests' own claim, through the CLI).
"""
from __future__ import annotations

import json

import torch

from common.bench import parity


def test_first_difference():
    assert parity.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert parity.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert parity.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early: a difference at its end
    assert parity.first_difference([1, 2, 3, 4], [1, 2, 3]) == 3
    assert parity.first_difference([], [7]) == 0


def test_compare_reports_each_difference_with_the_reference_margin(tiny, hf_tiny, hf_greedy):
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    reference = [hf_greedy(p, 6) for p in prompts]
    changed = list(reference[1])
    changed[3] = (changed[3] + 1) % tiny.config.vocab_size
    result = parity.compare([reference[0], changed], reference, prompts, hf_tiny)
    assert (result["identical"], result["first_tokens_equal"]) == (1, 2)
    assert result["agreement"] == (len(reference[0]) + 3) / (len(reference[0]) + len(reference[1]))
    (diff,) = result["differences"]
    assert (diff["request"], diff["first_difference"], diff["ours"], diff["reference"]) == (1, 3, changed[3], reference[1][3])
    with torch.inference_mode():
        logits = hf_tiny(torch.tensor([prompts[1] + reference[1][:3]], device=hf_tiny.device)).logits[0, -1]
    best, second = logits.float().topk(2).values.tolist()
    assert abs(diff["reference_margin"] - (best - second)) < 1e-5 and diff["reference_margin"] >= 0
    assert result["max_margin_at_difference"] == diff["reference_margin"]


def test_fp32_run_on_tiny_is_identical_for_every_stage_it_runs(tmp_path):
    out = tmp_path / "parity.json"
    assert parity.main(["--model", "tiny", "--device", "cpu", "--stages", "2,3,9", "--random-prompts", "3",
                        "--max-new-tokens", "6", "--max-batch-size", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "parity" and result["dtype"] == "float32"
    assert result["dtype_reason"].startswith("default: float32")  # parity's default: the exact engine
    assert f"Dtype: {result['dtype_reason']}" in parity.format_parity(result)
    assert list(result["entries"]) == ["s02_kv_cache", "s03_paged_attention", "s09_batched_worker_lookups"]
    n = len(parity.PROMPTS) + 3
    for entry in result["entries"].values():
        assert (entry["requests"], entry["identical"], entry["agreement"], entry["differences"]) == (n, n, 1.0, [])
    assert result["command"].startswith("stagewise parity --model tiny") and result["env"]["git_commit"]
