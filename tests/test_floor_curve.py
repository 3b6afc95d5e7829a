"""`stagewise floor-curve` (common/bench/floor_curve.py): the matmul floor by batch, in rounds, in one process."""
from __future__ import annotations

import json

import pytest

from common import cli
from common.bench import floor_curve


def test_every_batch_is_timed_once_a_round_and_its_floor_is_the_median(monkeypatch) -> None:
    calls: list[int] = []
    times = iter([5.0, 9.0, 10.0, 7.0, 6.0, 30.0])  # round 1: b1, b4; round 2: b4, b1; round 3: b1, b4

    def fake_floor(model, batch: int, **timing) -> float:
        assert timing == {"min_time_s": 0.3, "packed": True}  # each sample as the benches' floor takes it
        calls.append(batch)
        return next(times)

    monkeypatch.setattr(floor_curve, "matmul_floor_ms", fake_floor)
    rows = floor_curve.measure(object(), [1, 4], rounds=3)
    assert calls == [1, 4, 4, 1, 1, 4]  # interleaved, every other round backwards
    assert [r["samples_ms"] for r in rows] == [[5.0, 7.0, 6.0], [9.0, 10.0, 30.0]]
    assert [r["floor_ms"] for r in rows] == [6.0, 10.0]
    assert rows[1]["ms_per_row"] == pytest.approx(2.5)


def test_both_products_are_timed_back_to_back_each_first_in_turn(monkeypatch) -> None:
    calls: list[tuple[int, bool]] = []

    def fake_floor(model, batch: int, min_time_s: float, packed: bool) -> float:
        calls.append((batch, packed))
        return 8.0 if packed else 6.0

    monkeypatch.setattr(floor_curve, "matmul_floor_ms", fake_floor)
    rows = floor_curve.measure(object(), [1, 4], rounds=2, matmul="both")
    assert calls == [(1, True), (1, False), (4, True), (4, False),  # round 1: the model's products first
                     (4, False), (4, True), (1, False), (1, True)]  # round 2: backwards, F.linear first
    assert rows[0]["floor_ms"] == 8.0 and rows[0]["f_linear_ms"] == 6.0 and rows[0]["f_linear_vs_model"] == 0.75
    assert rows[1]["f_linear_samples_ms"] == [6.0, 6.0] and rows[1]["ms_per_row"] == 2.0
    calls.clear()
    only = floor_curve.measure(object(), [2], rounds=1, matmul="F.linear")
    assert calls == [(2, False)] and only[0]["floor_ms"] == 6.0 and "f_linear_ms" not in only[0]


def test_the_floor_through_f_linear_hands_linear_no_packed_weight(monkeypatch) -> None:
    from common.bench import floor
    from common.loader import load_model

    model = load_model("tiny", device="cpu", dtype="float32").model
    seen: list[bool] = []
    real = floor.linear
    monkeypatch.setattr(floor, "linear", lambda x, w, b, packed, rows: seen.append(packed is None) or real(x, w, b, packed, rows))
    floor.matmul_floor_ms(model, 2, warmup=0, repeats=1, packed=False)  # one step: one call a matmul
    assert seen == [True] * len(floor.decode_matmuls(model))
    seen.clear()
    floor.matmul_floor_ms(model, 2, warmup=0, repeats=1)  # the model's own: packed where it packed them
    assert seen == [pw is None for _, _, pw, _ in floor.decode_matmuls(model)]


def test_floor_curve_on_tiny_writes_its_json(tmp_path, capsys) -> None:
    out = tmp_path / "curve.json"
    assert cli.main(["floor-curve", "--model", "tiny", "--batches", "1,8", "--rounds", "2", "--matmul", "both",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "floor-curve" and data["model"] == "tiny" and data["dtype"] == "float32"
    assert [r["batch"] for r in data["batches"]] == [1, 8]
    assert all(len(r["samples_ms"]) == 2 and r["floor_ms"] > 0 for r in data["batches"])
    assert data["batches"][1]["ms_per_row"] == pytest.approx(data["batches"][1]["floor_ms"] / 8)
    assert all(len(r["f_linear_samples_ms"]) == 2 and r["f_linear_ms"] > 0 for r in data["batches"])
    assert data["command"].startswith("stagewise floor-curve --model tiny") and data["env"]["git_commit"]
    text = capsys.readouterr().out
    assert "matmul floor by batch: tiny on cpu (float32)" in text and "2 rounds in one process" in text


def test_the_report_gives_each_batch_its_cost_per_row_and_its_floor_against_the_first() -> None:
    result = {"model": "m", "device": "cpu", "dtype": "float32", "dtype_reason": "asked: float32",
              "config": {"rounds": 2, "matmul": "model"},
              "batches": [{"batch": 2, "floor_ms": 10.0, "ms_per_row": 5.0, "samples_ms": [9.0, 11.0]},
                          {"batch": 8, "floor_ms": 25.0, "ms_per_row": 3.125, "samples_ms": [25.0, 25.0]}]}
    lines = floor_curve.format_curve(result).splitlines()
    assert lines[0] == "=== matmul floor by batch: m on cpu (float32) ==="
    assert "2 rounds in one process" in lines[2] and "as the model runs them" in lines[3] and "x b2" in lines[4]
    assert lines[5].split() == ["2", "10.00", "5.00", "1.00x", "9.0", "11.0"]
    assert lines[6].split() == ["8", "25.00", "3.12", "2.50x", "25.0", "25.0"]
    result["config"]["matmul"] = "both"
    for row in result["batches"]:
        row.update(f_linear_ms=row["floor_ms"] / 2, f_linear_vs_model=0.5, f_linear_samples_ms=[1.0])
    lines = floor_curve.format_curve(result).splitlines()
    assert "F.linear ms" in lines[4] and lines[6].split()[4:6] == ["12.50", "0.50x"]


@pytest.mark.parametrize("argv, field", [
    (["--batches", "1,x"], "--batches"), (["--batches", "0,4"], "--batches"), (["--batches", "4,4"], "--batches"),
    (["--batches", ""], "--batches"), (["--batches", "-2"], "--batches"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_flags_are_refused_by_name_before_the_model_loads(argv, field, monkeypatch) -> None:
    import common.loader

    monkeypatch.setattr(common.loader, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=f"^{field}"):
        floor_curve.main(["--model", "tiny", *argv])
