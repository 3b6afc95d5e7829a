"""Fresh processes per engine (common/bench/spawn.py, child.py) and the matmul floor (common/bench/floor.py).

Why: a comparison's numbers are only trusted when each engine ran alone in its own process, so
the round trip parent -> worker -> parent must keep every field and the greedy token check; a
worker that dies must say which engine, not hang; and the floor must time exactly the matmuls
one decode step makes. No test asserts a timing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.bench import floor
from common.bench.spawn import WorkerError, spawn

ROOT = Path(__file__).resolve().parents[1]


def test_floor_times_exactly_the_decode_steps_matmuls(tiny, monkeypatch) -> None:
    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool, object]] = []
    real = floor.linear

    def counting(x, w, b=None, packed=None, unpacked_rows=0):
        calls.append((tuple(x.shape), tuple(w.shape), b is not None, packed, unpacked_rows))
        return real(x, w, b, packed, unpacked_rows)

    monkeypatch.setattr(floor, "linear", counting)
    ms = floor.matmul_floor_ms(tiny.model, 3, warmup=1, repeats=2)
    layers = tiny.config.num_layers
    per_step = 4 * layers + 1  # qkv, o, gate_up, down per layer, then the lm_head
    assert ms > 0 and len(calls) == 3 * per_step
    assert all(x[0] == 3 and x[1] == w[1] for x, w, *_ in calls)  # [B, in] @ [out, in]
    assert calls[per_step - 1][1] == tuple(tiny.model.lm_head_weight.shape)
    # the very weights the model's own calls use: packed for oneDNN where the model packed them
    block = tiny.model.layers[0]
    assert [c[3] for c in calls[:4]] == [block.packed.get(n) for n in block.PROJECTIONS]
    assert calls[per_step - 1][3] is tiny.model.lm_head_packed
    # and F.linear up to the rows the model measured faster so at load
    measured = tiny.model.unpacked_rows
    tiny.model.set_unpacked_rows({"qkv": 3, "lm_head": 2})
    try:
        calls.clear()
        floor.matmul_floor_ms(tiny.model, 3, warmup=0, repeats=1)
        assert [c[4] for c in calls[:4]] == [3, 0, 0, 0] and calls[-1][4] == 2
    finally:
        tiny.model.set_unpacked_rows(measured)  # the fixture is the session's


def test_decode_batch_and_x_floor() -> None:
    assert floor.decode_batch(16, 32) == 16 and floor.decode_batch(16, 4) == 4
    result = floor.with_x_floor({"decode_step_ms": 6.0}, {"floor_ms": 2.0, "floor_batch": 4})
    assert result == {"decode_step_ms": 6.0, "floor_ms": 2.0, "floor_batch": 4, "x_floor": 3.0}
    assert floor.with_x_floor({"decode_step_ms": 6.0}, None) == {"decode_step_ms": 6.0}


def test_floor_sampler_keeps_one_sample_per_run_and_reports_their_median(tiny, monkeypatch) -> None:
    samples = iter([5.0, 1.0, 3.0])
    monkeypatch.setattr(floor, "matmul_floor_ms", lambda model, batch, **kw: next(samples))
    sampler = floor.FloorSampler(tiny.model, 4)
    for _ in range(3):
        sampler()  # as run_engines calls it after each timed run
    assert sampler.fields() == {"floor_ms": 3.0, "floor_batch": 4, "floor_samples_ms": [5.0, 1.0, 3.0],
                                "matmul_unpacked_rows": tiny.model.unpacked_rows}  # the products the floor ran
    lone = floor.FloorSampler(tiny.model, 2)
    monkeypatch.setattr(floor, "matmul_floor_ms", lambda model, batch, **kw: 7.0)
    assert lone.fields()["floor_samples_ms"] == [7.0]  # no timed run: measured once, when asked


def no_weights_here(monkeypatch) -> None:
    """Make loading the model's weights in this (the parent) process fail; workers are other processes."""
    from common.model import DecoderModel

    def refuse(*args, **kwargs):
        raise AssertionError("the parent loaded the model's weights; only its workers run engines")
    monkeypatch.setattr(DecoderModel, "from_pretrained", refuse)


def test_compare_runs_each_engine_in_its_own_process(tmp_path, capfd, monkeypatch) -> None:
    from common.bench.harness import run_stage_bench

    no_weights_here(monkeypatch)  # the tokenizer builds the workload; the children load the model
    out = tmp_path / "r.json"
    data = run_stage_bench("stages.s03_paged_attention", [
        "--model", "tiny", "--device", "cpu", "--compare", "--num-requests", "3", "--max-new-tokens", "3",
        "--prompt-len-min", "4", "--prompt-len-max", "9", "--warmup-runs", "1", "--repeat-runs", "1",
        "--json", str(out)])
    assert json.loads(out.read_text())["engine"] == "s03_paged_attention"
    other = data["compare"][0]
    assert other["engine"] == "s02_kv_cache"
    pids = {data["process"]["pid"], other["process"]["pid"], os.getpid()}
    assert len(pids) == 3 and data["process"]["fresh_process"] and other["process"]["exit_code"] == 0
    assert data["correctness"] == {"checked": True, "equal": True, "mismatches": {}}
    for r in (data, other):
        assert r["completion_tokens"] == 9 and len(r["runs"]) == 1 and "peak_kv_bytes" in r["kv"]
        assert r["floor_batch"] == 3 and r["floor_ms"] > 0 and r["x_floor"] > 0
    assert data["config"]["same_process"] is False
    text = capfd.readouterr().out
    assert "=== s02_kv_cache: fresh process ===" in text and "Process: fresh, this engine alone" in text
    assert "correctness: greedy token ids identical across s03_paged_attention, s02_kv_cache" in text


def test_an_engine_run_in_this_process_gets_the_weights_and_a_floor(tmp_path) -> None:
    """The parent loads weights-free first; a bench without --compare (or with --same-process) and a
    --same-process ladder run engines here, so they load the weights after and sample the floor."""
    from common.bench import ladder
    from common.bench.harness import run_stage_bench

    small = ["--model", "tiny", "--device", "cpu", "--num-requests", "2", "--max-new-tokens", "2",
             "--warmup-runs", "0", "--repeat-runs", "1"]
    alone = run_stage_bench("stages.s03_paged_attention", [*small, "--prompt-len-min", "4", "--prompt-len-max", "9"])
    assert alone["process"]["pid"] == os.getpid() and alone["completion_tokens"] == 4 and alone["floor_ms"] > 0
    data = ladder.run_ladder([*small, "--out", str(tmp_path), "--stages", "2,3", "--no-hf", "--same-process"])
    assert all(e["process"]["pid"] == os.getpid() and e["floor_ms"] > 0 for e in data["entries"])
    assert data["correctness"]["equal"]


def test_rounds_interleave_fresh_processes_and_pool_their_runs(tmp_path, capfd) -> None:
    """--rounds 2: A B, A B, each in a new process; each engine's JSON holds both processes' runs
    and floor samples, and the floor is their median."""
    from common.bench.harness import run_stage_bench

    data = run_stage_bench("stages.s03_paged_attention", [
        "--model", "tiny", "--device", "cpu", "--compare", "--rounds", "2", "--num-requests", "2",
        "--max-new-tokens", "2", "--prompt-len-min", "4", "--prompt-len-max", "9", "--warmup-runs", "0",
        "--repeat-runs", "1"])
    text = capfd.readouterr().out
    order = [line.split(":")[0].strip("= ") for line in text.splitlines() if "fresh process, round" in line]
    assert order == ["s03_paged_attention", "s02_kv_cache", "s03_paged_attention", "s02_kv_cache"]
    pids = set()
    for r in (data, data["compare"][0]):
        assert len(r["runs"]) == 2 and r["process"]["rounds"] == 2 and len(r["floor_samples_ms"]) == 2
        assert r["floor_ms"] == pytest.approx(sum(r["floor_samples_ms"]) / 2, rel=1e-3)
        pids |= set(r["process"]["pids"])
    assert len(pids) == 4 and os.getpid() not in pids
    assert data["correctness"]["equal"] and "2 processes interleaved" in text
    assert "Repeats: 1 (+0 warmup) in each of 2 processes, medians of all 2" in text


def test_merge_rounds_pools_runs_and_catches_tokens_that_differ() -> None:
    from common.bench.spawn import merge_rounds

    def worker(pid: int, tokens: list[list[int]], floor_ms: float) -> dict:
        return {"summaries": [{"pid": pid}], "first_tokens": tokens, "kv": {"pid": pid}, "setup_s": [0.1],
                "floor": {"floor_ms": floor_ms, "floor_batch": 2, "floor_samples_ms": [floor_ms]},
                "process": {"fresh_process": True, "engines_in_process": 1, "pid": pid, "exit_code": 0},
                "error": None}

    one = worker(1, [[5, 6]], 10.0)
    assert merge_rounds([one]) is one
    got = merge_rounds([one, worker(2, [[5, 6]], 30.0), worker(3, [[5, 6]], 11.0)])
    assert [s["pid"] for s in got["summaries"]] == [1, 2, 3] and got["kv"] == {"pid": 3}
    assert got["floor"]["floor_ms"] == 11.0 and got["floor"]["floor_samples_ms"] == [10.0, 30.0, 11.0]
    assert got["process"]["pids"] == [1, 2, 3] and got["process"]["rounds"] == 3 and got["error"] is None
    assert "differ between rounds" in merge_rounds([one, worker(2, [[5, 7]], 10.0)])["error"]


def test_rounds_need_fresh_processes(capsys) -> None:
    from common.bench import flags, ladder_rungs
    from common.bench.harness import run_stage_bench

    with pytest.raises(ValueError, match="--rounds"):
        run_stage_bench("stages.s03_paged_attention", ["--model", "tiny", "--rounds", "2"])  # nothing compared
    with pytest.raises(ValueError, match="--rounds"):
        run_stage_bench("stages.s03_paged_attention", ["--model", "tiny", "--rounds", "2", "--compare",
                                                       "--same-process"])
    with pytest.raises(ValueError, match="--rounds"):
        ladder_rungs.parse_args(["--out", "/tmp/x", "--rounds", "2", "--same-process"])
    with pytest.raises(ValueError, match="--rounds"):
        ladder_rungs.parse_args(["--out", "/tmp/x", "--rounds", "0"])
    assert flags.build_parser("bench").parse_args([]).rounds == 1


def test_a_rung_that_fails_in_a_round_is_not_run_again(monkeypatch) -> None:
    from types import SimpleNamespace

    from common.bench import spawn as spawner

    calls: list[str] = []

    def fake_spawn(job: dict, engine: str) -> dict:
        calls.append(engine)
        return {"workload_digest": spawner.workload_digest([]), "summaries": [{}], "first_tokens": [[1]],
                "kv": None, "setup_s": [], "process": {"pid": len(calls)},
                "floor": {"floor_ms": 1.0, "floor_batch": 1, "floor_samples_ms": [1.0]},
                "error": "RuntimeError: boom" if engine == "bad" else None}

    monkeypatch.setattr(spawner, "spawn", fake_spawn)
    good, bad = (SimpleNamespace(name=n, error=None) for n in ("good", "bad"))
    spawner.run_ladder_engines([good, bad], [], [], rounds=3)
    assert calls == ["good", "bad", "good", "good"]
    assert bad.error == "RuntimeError: boom" and good.error is None and len(good.summaries) == 3


def test_ladder_rounds_run_every_rung_once_per_round(monkeypatch, tmp_path) -> None:
    from common.bench import ladder, spawn as spawner

    calls: list[str] = []
    real_spawn = spawner.spawn

    def recording_spawn(job: dict, engine: str) -> dict:
        calls.append(engine)
        return real_spawn(job, engine)

    monkeypatch.setattr(spawner, "spawn", recording_spawn)
    no_weights_here(monkeypatch)
    data = ladder.run_ladder(["--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--num-requests", "2",
                              "--max-new-tokens", "2", "--repeat-runs", "1", "--warmup-runs", "0", "--stages", "2,3",
                              "--no-hf", "--rounds", "2"])
    assert calls == ["s02_kv_cache", "s03_paged_attention", "s02_kv_cache", "s03_paged_attention"]
    assert all(len(e["runs"]) == 2 and e["process"]["rounds"] == 2 for e in data["entries"])
    assert data["correctness"]["equal"]
    assert "in each of 2 fresh processes per engine, interleaved (2 timed runs per engine)" \
        in (tmp_path / "ladder.cpu.txt").read_text()


def test_a_failing_worker_names_its_engine() -> None:
    job = {"kind": "bench", "package": "no_such_stage_package", "argv": [], "engine": "s42_broken", "mode": "offline"}
    with pytest.raises(WorkerError, match=r"s42_broken: its worker process \(pid \d+\) exited with code 1"):
        spawn(job, "s42_broken")


def test_a_failing_ladder_rung_is_skipped_with_the_reason(monkeypatch, tmp_path) -> None:
    from common.bench import ladder, spawn as spawner

    def boom(job: dict, engine: str) -> dict:
        raise WorkerError(f"{engine}: its worker process (pid 1) exited with code 1; its error is printed above")

    monkeypatch.setattr(spawner, "spawn", boom)
    with pytest.raises(SystemExit, match="every engine failed"):
        ladder.run_ladder(["--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--num-requests", "2",
                           "--max-new-tokens", "2", "--repeat-runs", "1", "--warmup-runs", "0", "--stages", "2",
                           "--no-hf"])


def test_decode_step_preset() -> None:
    import argparse

    from common.bench import ladder_rungs, ladder_workloads

    args = ladder_rungs.parse_args(["--workload", "decode-step", "--out", "/tmp/x"])
    assert args.max_batch_size == 16
    kw = ladder_workloads.workload_kwargs(
        argparse.Namespace(workload="decode-step", num_requests=None, max_new_tokens=None), 8192, [])
    assert kw == {"num_requests": 16, "prompt_len_range": (160, 160), "max_new_tokens": 40, "stop_on_eos": False}
    assert ladder_rungs.parse_args(["--out", "/tmp/x"]).max_batch_size == 8


def test_old_results_without_the_floor_still_render(tmp_path) -> None:
    import sys

    from common.bench import ladder_report
    from common.bench.report import format_comparison, format_report

    old = json.loads((ROOT / "tests/data/old_ladder.cpu.json").read_text())  # written before the floor existed
    assert "x_floor" not in old["entries"][0]
    table = ladder_report.format_table(old)
    assert "x floor" in table and "engines alternating in one process" in table
    new = json.loads(json.dumps(old))
    new["config"]["same_process"] = False
    for e in new["entries"]:
        e.update(decode_step_ms=4.0, floor_ms=2.0, floor_batch=8, x_floor=2.0)
    table = ladder_report.format_table(new)
    assert "each engine in its own fresh process" in table and " 2.00 " in table and "at batch 8" in table

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import stagewise as hook

    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert "| x floor |" in hook.render_ladder_table(tmp_path, "new.json", "ladder.md")
    assert "| — |" in hook.render_ladder_table(tmp_path, "old.json", "ladder.md")
    bench_old = json.loads((ROOT / "tests/data/old_s02_kv_cache.cpu.json").read_text())  # idem
    assert "decode_step_ms" not in bench_old
    assert "Decode step" not in format_report(bench_old, {})
    (tmp_path / "b.json").write_text(json.dumps(bench_old))
    assert "x floor" not in hook.render_bench_results(tmp_path, "b.json", "s.md")
    bench_new = dict(bench_old, decode_step_ms=5.0, floor_ms=2.5, floor_batch=8, x_floor=2.0,
                     compare=[dict(c, decode_step_ms=6.0, floor_ms=2.5, x_floor=2.4) for c in bench_old["compare"]])
    (tmp_path / "b2.json").write_text(json.dumps(bench_new))
    md = hook.render_bench_results(tmp_path, "b2.json", "s.md")
    assert "2.00× the matmul floor" in md and "| x floor |" in md
    assert "x floor" in format_comparison([bench_new, *bench_new["compare"]])
