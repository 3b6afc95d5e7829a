"""`stagewise profile-prefill`: the prefill it times is the whole prompt's, and its floor the same products."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.bench import floor, profile_prefill
from common.bench.profiling import group_of


def run(tmp_path: Path, stage: str, prompt_len: int, *extra: str) -> dict:
    out = tmp_path / f"prefill.{stage}.json"
    assert profile_prefill.main(["--stage", stage, "--model", "tiny", "--device", "cpu", "--dtype", "float32",
                                 "--prompt-len", str(prompt_len), "--repeats", "2", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", ["2", "9"])
def test_profile_prefill_on_tiny(stage: str, tmp_path: Path, capsys, tiny) -> None:
    r = run(tmp_path, stage, 40)
    assert "x floor" in capsys.readouterr().out
    assert len(r["prefill_samples_ms"]) == 2 == len(r["floor_samples_ms"]) and r["prefill_ms"] > 0
    assert r["x_floor"] == pytest.approx(r["prefill_ms"] / r["floor_ms"])
    # One forward: each projection once (oneDNN's op where the weights are packed, as on a CPU in fp32).
    mm = [row for row in r["ops"] if row["group"] == "matmul"]
    assert len(mm) == 1 and mm[0]["calls_per_step"] == 4 * tiny.config.num_layers + 1
    # The groups are the op rows' (common/bench/profiling.py, tested in test_profile_decode.py on ops of known
    # names): every listed op sits in its name's group, and the one matmul op is the whole group.
    assert all(row["group"] == group_of(row["op"]) for row in r["ops"])
    assert r["groups_ms_profiled"]["matmul"] == pytest.approx(mm[0]["ms_per_step"])
    assert r["groups_ms_profiled"]["attention"] > 0
    assert r["projection_gflop"] == pytest.approx(profile_prefill.projection_flops(tiny.model, 40) / 1e9)
    c = tiny.config  # 40 * 41 / 2 causal pairs, q.k and p.v, every query head and layer
    assert r["attention_gflop"] * 1e9 == pytest.approx(4 * 820 * c.head_dim * c.num_heads * c.num_layers)
    assert r["attention_gflops_profiled"] > 0
    assert r["env"]["git_commit"] and r["command"].startswith("stagewise profile-prefill --stage")


def test_chunked_prefill_is_timed_whole(tmp_path: Path, tiny) -> None:
    """Stage 11 prefills a prompt longer than its token budget in chunks, one forward each: the
    profiled run holds all of them, so every projection runs once per chunk."""
    r = run(tmp_path, "11", 100, "--max-num-batched-tokens", "32")
    mm = [row for row in r["ops"] if row["group"] == "matmul"]
    assert mm[0]["calls_per_step"] == 4 * (4 * tiny.config.num_layers + 1)  # ceil(100 / 32) chunks
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        run(tmp_path, "9", 100, "--max-num-batched-tokens", "32")


def test_projection_flops_and_the_prefill_floor(tiny, monkeypatch) -> None:
    config = tiny.config
    per_layer = sum(w.shape[0] * w.shape[1] for w, *_ in floor.decode_matmuls(tiny.model)[:4])
    expected = 2 * (10 * config.num_layers * per_layer + config.vocab_size * config.hidden_size)
    assert profile_prefill.projection_flops(tiny.model, 10) == expected
    rows: list[int] = []
    real = floor.linear
    monkeypatch.setattr(floor, "linear", lambda x, *args: rows.append(x.shape[0]) or real(x, *args))
    floor.matmul_floor_ms(tiny.model, 10, warmup=1, repeats=1, lm_head_rows=1)
    per_step = 4 * config.num_layers + 1
    assert rows[:per_step] == [10] * (per_step - 1) + [1]  # the lm_head on the last row only
    with pytest.raises(ValueError, match="lm_head_rows"):
        floor.matmul_floor_ms(tiny.model, 10, lm_head_rows=0)
