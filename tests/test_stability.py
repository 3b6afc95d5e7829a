"""`stagewise stability` (common/bench/stability.py): N fresh processes of one stage's bench.

Why: the tool judges whether separate processes agree, so its arithmetic (median, largest
deviation) and its JSON must be right; the processes themselves are faked here (the worker
round trip is tested in test_engine_worker.py). No timing is asserted.
"""
from __future__ import annotations

import json
import statistics

import pytest

from common import cli
from common.bench import stability


def test_deviation_from_the_median() -> None:
    d = stability.deviation([100.0, 90.0, 120.0, 100.0, 105.0])
    assert d["median"] == 100.0 and d["min"] == 90.0 and d["max"] == 120.0
    assert d["max_deviation_pct"] == pytest.approx(20.0)


def test_stability_runs_n_processes_and_writes_json(monkeypatch, tmp_path, capsys) -> None:
    seen: list[tuple[str, list[str], int]] = []

    def fake_run_one(stage: str, bench_argv: list[str], index: int, out) -> dict:
        seen.append((stage, bench_argv, index))
        return {"model": "tiny", "device": "cpu", "dtype": "float32", "dtype_reason": "asked: float32",
                "config": {"num_requests": 4}, "env": {"git_commit": "abc"}, "throughput_tok_s": {"completion": [100.0, 110.0, 90.0][index]},
                "decode_step_ms": 5.0, "floor_ms": 2.0, "x_floor": 2.5, "process": {"pid": 1000 + index}}

    monkeypatch.setattr(stability, "run_one", fake_run_one)
    out = tmp_path / "stab.json"
    assert cli.main(["stability", "--stage", "9", "--processes", "3", "--model", "tiny", "--num-requests", "4",
                     "--json", str(out)]) == 0
    assert [s[2] for s in seen] == [0, 1, 2] and seen[0][1] == ["--model", "tiny", "--num-requests", "4"]
    data = json.loads(out.read_text())
    assert data["stage"] == "s09_batched_worker_lookups" and data["env"] == {"git_commit": "abc"}
    assert data["dtype_reason"] == "asked: float32"
    assert data["config"]["processes"] == 3 and data["config"]["bench_config"] == {"num_requests": 4}
    assert [p["pid"] for p in data["processes"]] == [1000, 1001, 1002]
    assert data["summary"]["compl tok/s"]["median"] == 100.0
    assert data["summary"]["compl tok/s"]["max_deviation_pct"] == pytest.approx(10.0)
    text = capsys.readouterr().out
    assert "=== stability: s09_batched_worker_lookups, 3 fresh processes ===" in text
    assert "max deviation from the median 10.0%" in text and "x floor" in text


def test_runs_inside_each_process_are_summarised_too(monkeypatch, tmp_path, capsys) -> None:
    """--repeat-runs 3: the spread of each process's own runs, beside the spread between processes."""
    runs = [[100.0, 80.0, 100.0], [110.0, 110.0, 110.0]]

    def fake_run_one(stage: str, bench_argv: list[str], index: int, out) -> dict:
        return {"model": "tiny", "device": "cpu", "dtype": "float32", "config": {}, "env": {},
                "throughput_tok_s": {"completion": statistics.median(runs[index])},
                "runs": [{"throughput_tok_s": {"completion": v}} for v in runs[index]], "process": {"pid": index}}

    monkeypatch.setattr(stability, "run_one", fake_run_one)
    out = tmp_path / "stab.json"
    assert cli.main(["stability", "--stage", "9", "--processes", "2", "--repeat-runs", "3", "--json", str(out)]) == 0
    inside = json.loads(out.read_text())["summary"]["within_process"]
    assert inside == {"runs_per_process": 3, "max_deviation_pct_per_process": [20.0, 0.0], "max_deviation_pct": 20.0}
    assert "inside each process (3 timed runs): max deviation from that process's median 20.0%" in capsys.readouterr().out
    assert stability.within_processes([{"runs": [{"throughput_tok_s": {"completion": 1.0}}]}]) is None
