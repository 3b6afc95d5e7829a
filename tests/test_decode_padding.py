"""scripts/decode_padding_bench.py: one padded K/V rectangle against rows split in two by length,
whose result stage 13's page cites. The split must attend exactly as the one rectangle does (only
the padding differs), and must cut where the two rectangles hold the fewest blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_script


def test_split_point_cuts_where_the_two_rectangles_are_smallest() -> None:
    bench = load_script("decode_padding_bench")
    # one long row and three short ones: the long one alone, the rest at their own width
    assert bench.split_point([10, 2, 2, 2]) == (1, 10 + 3 * 2)
    # rows of one length: no cut beats one rectangle
    assert bench.split_point([4, 4, 4]) == (3, 12)
    assert bench.split_point([7]) == (1, 7)
    # every cut is tried: the best here is after two rows, not one
    assert bench.split_point([9, 9, 1, 1, 1, 1]) == (2, 2 * 9 + 4 * 1)


def test_each_row_attends_over_exactly_its_own_keys_both_ways() -> None:
    """Against a reference that knows nothing of rectangles: each row's own blocks, cut to its length."""
    import torch
    import torch.nn.functional as F

    bench = load_script("decode_padding_bench")
    g = torch.Generator().manual_seed(0)
    H, D, bs = bench.HKV, bench.HEAD_DIM, bench.BLOCK
    pool = bench.kv_pool(40, 2, torch.float32, g)
    step = bench.Step([33, 200, 7, 90, 16], pool, g)
    assert len(step.split) == 2  # these lengths are worth a cut
    for layer in (0, 1):
        for groups in (step.one, step.split):
            out = step.attend(pool, layer, groups)  # [Hkv, B, G, D], rows longest first
            for i, n in enumerate(step.lengths.tolist()):
                blocks = step.table[i, : -(-n // bs)]
                keys, values = (t[layer][:, blocks].reshape(H, -1, D)[:, :n] for t in (pool.k, pool.v))
                expected = F.scaled_dot_product_attention(step.q[:, i], keys, values)  # [Hkv, G, D]
                torch.testing.assert_close(out[:, i], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_split_attends_as_one_rectangle_and_the_result_says_so(tmp_path: Path, dtype: str) -> None:
    bench = load_script("decode_padding_bench")
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[300, 40, 35, 17], [], [64, 64], [5]]))
    out = tmp_path / "padding.json"
    assert bench.main(["--lengths", str(lengths), "--every", "1", "--layers", "2", "--dtype", dtype,
                       "--rounds", "2", "--min-time-s", "0.001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps_recorded"] == 4 and result["steps_replayed"] == 3  # the empty step is skipped
    assert result["layers"] == 2
    assert result["lengths"] == [[300, 40, 35, 17], [64, 64], [5]]
    # the same attention: masked keys weigh nothing, whatever the rectangle's width
    assert result["max_abs_difference"] <= (1e-5 if dtype == "float32" else 2e-2)
    keys = 19 * 16 * 4 + 4 * 16 * 2 + 1 * 16  # one rectangle a step: rows x the longest row's blocks
    assert result["padded_vs_real"] == pytest.approx(keys / (300 + 40 + 35 + 17 + 128 + 5))
    assert result["one_vs_split_blocks"] == pytest.approx((19 * 4 + 4 * 2 + 1) / (19 + 3 * 3 + 4 * 2 + 1))
    assert result["split_vs_one"] == pytest.approx(result["split_ms"] / result["one_ms"])
    assert len(result["samples_ms"]["one"]) == len(result["samples_ms"]["split"]) == 2
    assert result["command"].startswith("python scripts/decode_padding_bench.py") and "cpu_capability" in result["env"]


def test_a_record_file_replays_with_the_bench_that_wrote_it(tmp_path: Path) -> None:
    """`--record` writes {"bench", "env", "steps"}; the replay keeps the bench's summary beside its figures."""
    bench = load_script("decode_padding_bench")
    lengths = tmp_path / "record.json"
    lengths.write_text(json.dumps({"bench": {"dtype": "float32", "decode_step_ms": 80.0}, "env": {}, "steps": [[40, 3]]}))
    out = tmp_path / "padding.json"
    assert bench.main(["--lengths", str(lengths), "--every", "1", "--layers", "1", "--dtype", "float32",
                       "--rounds", "1", "--min-time-s", "0.001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["recorded_by"] == {"dtype": "float32", "decode_step_ms": 80.0} and result["lengths"] == [[40, 3]]
    with pytest.raises(SystemExit):  # one of --record and --lengths, not neither
        bench.main(["--dtype", "float32"])
