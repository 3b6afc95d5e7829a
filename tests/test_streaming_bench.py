"""The streaming benchmark against a fake SchedulerManager (no model, no stage needed).

The fake keeps the real manager's contract: add_request returns at once and stamps
"submitted"; a worker thread produces tokens; the handle streams chunks and returns a
Completion with timings and per-token timestamps.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from common import stages as registry
from common.requests import Completion, Request, SamplingParams
from common.bench.streaming import run_streaming_once


class FakeTokenizer:
    vocab_size = 5000
    all_special_ids = [0, 1, 2]
    eos_token_id = 2
    pad_token_id = None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1000 + ord(c) % 4000 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


@dataclass
class StreamChunk:
    text: str
    token_ids: list[int]


class FakeHandle:
    def __init__(self, rid: int) -> None:
        self.request_id = rid
        self.chunks: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.completion: Completion | None = None
        self.error: BaseException | None = None

    def __iter__(self):
        while (chunk := self.chunks.get()) is not None:
            yield chunk

    def result(self, timeout: float | None = None) -> Completion:
        if not self.done.wait(timeout):
            raise TimeoutError("fake request timed out")
        if self.error is not None:
            raise self.error
        return self.completion


class FakeEngine:
    def __init__(self, loaded, max_batch_size: int = 8) -> None:
        self.loaded = loaded

    def generate(self, requests):
        mgr = FakeManager(self)
        try:
            handles = [mgr.add_request(r.prompt, prompt_token_ids=r.prompt_token_ids, params=r.params) for r in requests]
            return [h.result(5) for h in handles]
        finally:
            mgr.close()

    def kv_stats(self) -> dict:
        return {"peak_kv_bytes": 0}


class FakeManager:
    """One worker thread, one request at a time, 0.5 ms per token."""

    instances: list["FakeManager"] = []

    def __init__(self, engine, max_batch_size: int = 8, record_token_timestamps: bool = False,
                 stream_interval: int = 1, tokenize_workers: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.stream_interval, self.clock = engine, stream_interval, clock
        self.tokenizer = engine.loaded.tokenizer
        self.pending: queue.Queue = queue.Queue()
        self.next_id = 0
        self.closed = False
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()
        FakeManager.instances.append(self)

    def add_request(self, prompt=None, *, prompt_token_ids=None, params=None) -> FakeHandle:
        submitted = self.clock()
        handle = FakeHandle(self.next_id)
        self.next_id += 1
        self.pending.put((handle, prompt, prompt_token_ids, params or SamplingParams(), submitted))
        return handle

    def _work(self) -> None:
        while (item := self.pending.get()) is not None:
            handle, prompt, ids, params, submitted = item
            try:
                params.validate()
                tokenized = self.clock()
                ids = list(ids) if ids is not None else self.tokenizer.encode(prompt)
                scheduled = self.clock()
                toks, stamps = [], []
                for k in range(params.max_new_tokens):
                    time.sleep(0.0005)
                    toks.append(100 + (sum(ids) + k) % 50)
                    stamps.append(self.clock())
                    handle.chunks.put(StreamChunk(self.tokenizer.decode(toks[-1:]), toks[-1:]))
                timings = {"submitted": submitted, "tokenized": tokenized, "scheduled": scheduled,
                           "first_token": stamps[0], "finished": stamps[-1]}
                handle.completion = Completion(prompt_token_ids=ids, token_ids=toks, text=self.tokenizer.decode(toks),
                                               finish_reason="length", token_timestamps=stamps, timings=timings,
                                               prompt=prompt)
            except ValueError as exc:
                handle.error = exc
            handle.chunks.put(None)
            handle.done.set()

    def close(self) -> None:
        self.closed = True
        self.pending.put(None)
        self.worker.join(5)


def _loaded():
    config = types.SimpleNamespace(max_position_embeddings=512, eos_token_ids=(2,))
    from tests.test_bench import fake_model
    return types.SimpleNamespace(name="fake", path=Path("/nonexistent"), tokenizer=FakeTokenizer(), config=config,
                                 device=torch.device("cpu"), dtype=torch.float32, dtype_reason="asked: float32",
                                 model=fake_model())


def _requests(n: int, max_new_tokens: int = 2) -> list[Request]:
    return [Request(prompt=f"Hello #{i}", params=SamplingParams(max_new_tokens=max_new_tokens)) for i in range(n)]


class VirtualClock:
    """A clock that only moves when told: `sleep_until` jumps to the deadline (never back), and the
    manager below advances it by what an add_request "costs". The submitter's schedule is then
    exact, whatever the machine's load, so a test can check the times it planned, not bound them."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.deadlines: list[float] = []  # every sleep_until the submitter asked for: its planned times

    def __call__(self) -> float:
        return self.now

    def sleep_until(self, deadline: float) -> None:
        self.deadlines.append(deadline)
        self.now = max(self.now, deadline)

    def advance(self, seconds: float) -> None:
        self.now += seconds


class VirtualTimeManager(FakeManager):
    """The fake manager on a VirtualClock: it stamps with that clock, notes when each call came,
    and each add_request takes `cost_s` of virtual time before it returns."""

    def __init__(self, engine, clock: VirtualClock, cost_s: float) -> None:
        super().__init__(engine, clock=clock)
        self.virtual, self.cost_s = clock, cost_s
        self.calls: list[float] = []

    def add_request(self, prompt=None, **kwargs) -> FakeHandle:
        self.calls.append(self.virtual())
        handle = super().add_request(prompt, **kwargs)
        self.virtual.advance(self.cost_s)
        return handle


def _run_on_virtual_time(n: int, interval_ms: float, schedule: str, cost_s: float) -> tuple[dict, VirtualClock, list[float]]:
    """One run of n requests on a virtual clock; (summary, the clock, when each add_request came, relative to t0)."""
    clock = VirtualClock()
    t0 = clock()
    manager = VirtualTimeManager(FakeEngine(_loaded()), clock, cost_s)
    try:
        summary, _ = run_streaming_once(manager, _requests(n), submit_interval_ms=interval_ms,
                                        submit_schedule=schedule, clock=clock, sleep_until=clock.sleep_until)
    finally:
        manager.close()
    return summary, clock, [c - t0 for c in manager.calls]


def test_absolute_schedule_plans_request_i_at_t0_plus_i_intervals():
    # 8 requests every 20 ms, each add_request taking 5 ms: request i is due, and sent, at i * 20 ms.
    summary, clock, calls = _run_on_virtual_time(8, 20.0, "absolute", cost_s=0.005)
    assert [d - 100.0 for d in clock.deadlines] == pytest.approx([0.020 * i for i in range(8)], abs=1e-9)
    assert calls == pytest.approx([0.020 * i for i in range(8)], abs=1e-9)
    assert summary["submit_wall_s"] == pytest.approx(0.140, abs=1e-9)
    assert summary["submit_lag_ms"] == pytest.approx({"p50": 0.0, "p95": 0.0, "p99": 0.0}, abs=1e-6)
    assert summary["add_request_ms"] == pytest.approx({"p50": 5.0, "p95": 5.0, "p99": 5.0}, abs=1e-6)
    assert summary["submit_interval_ms"] == 20.0 and summary["submit_schedule"] == "absolute"


def test_absolute_schedule_does_not_wait_again_after_a_slow_call():
    # add_request takes 30 ms, longer than the 20 ms interval: the schedule stays t0 + i * 20 ms
    # (not "20 ms after the last call returned"), so each next call goes at once and the lag grows.
    summary, clock, calls = _run_on_virtual_time(4, 20.0, "absolute", cost_s=0.030)
    assert [d - 100.0 for d in clock.deadlines] == pytest.approx([0.0, 0.020, 0.040, 0.060], abs=1e-9)
    assert calls == pytest.approx([0.0, 0.030, 0.060, 0.090], abs=1e-9)
    assert summary["submit_lag_ms"]["p50"] == pytest.approx(15.0, abs=1e-6)  # lags 0, 10, 20, 30 ms
    assert summary["add_request_ms"]["p50"] == pytest.approx(30.0, abs=1e-6)


def test_relative_schedule_waits_the_interval_after_each_call_returns():
    # 10 ms after each 5 ms call returns: calls 15 ms apart, where "absolute" would send them 10 ms apart.
    summary, _, calls = _run_on_virtual_time(4, 10.0, "relative", cost_s=0.005)
    assert calls == pytest.approx([0.0, 0.015, 0.030, 0.045], abs=1e-9)
    assert summary["submit_wall_s"] == pytest.approx(0.045, abs=1e-9) and summary["submit_schedule"] == "relative"
    assert summary["submit_lag_ms"]["p99"] == pytest.approx(0.0, abs=1e-6)


def test_the_real_clock_run_stamps_submissions_inside_their_calls(capsys):
    # The default clock is the one the manager stamps "submitted" with (time.perf_counter): every
    # stamp falls inside its add_request call, or the run warns. On the wall clock only what the
    # code guarantees is checked (never early, in order), not how late a busy machine made it.
    manager = RecordingManager(FakeEngine(_loaded()))
    try:
        summary, completions = run_streaming_once(manager, _requests(8), submit_interval_ms=5.0,
                                                  submit_schedule="absolute")
    finally:
        manager.close()
    assert "WARNING" not in capsys.readouterr().err
    assert [prompt for prompt, _ in manager.calls] == [f"Hello #{i}" for i in range(8)]
    assert summary["requests"] == 8 and summary["completion_tokens"] == 16
    for key in ("tokenize_ms", "queue_wait_ms", "prefill_to_first_token_ms", "ttft_ms", "itl_ms"):
        assert key in summary, key
    starts = [c.timings["submitted"] for c in completions]
    assert starts == sorted(starts)  # results in request order, submitted in that order
    assert summary["submit_lag_ms"]["p50"] >= 0.0  # _sleep_until never returns before the planned time


def test_a_failed_request_fails_the_run_loudly():
    manager = FakeManager(FakeEngine(_loaded()))
    reqs = _requests(3)
    reqs[1].params = SamplingParams(max_new_tokens=0)  # invalid: the fake worker reports it on the handle
    try:
        with pytest.raises(RuntimeError, match="1 of 3 requests failed; first: request 1"):
            run_streaming_once(manager, reqs)
    finally:
        manager.close()


@pytest.fixture
def fake_streaming_stages(monkeypatch):
    import common.loader

    def add(name: str, with_manager: bool) -> types.ModuleType:
        module = types.ModuleType(name)
        module.InferenceEngine = FakeEngine
        if with_manager:
            module.SchedulerManager = FakeManager
        module.BENCH = {"num_requests": 6, "max_new_tokens": 3}
        monkeypatch.setitem(sys.modules, name, module)
        return module

    modules = {"s03": add("fake_s03", False), "s04": add("fake_s04", True), "s05": add("fake_s05", True)}
    monkeypatch.setattr(registry, "STAGES", {3: "fake_s03", 4: "fake_s04", 5: "fake_s05"})
    monkeypatch.setattr(common.loader, "load_model", lambda *a, **k: _loaded())
    FakeManager.instances = []
    return modules


def test_streaming_bench_json_and_report(fake_streaming_stages, tmp_path, capsys):
    from common.bench.harness import run_stage_bench

    out = tmp_path / "r.json"
    run_stage_bench("fake_s05", ["--compare", "--submit-interval-ms", "5", "--warmup-runs", "1",
                                 "--repeat-runs", "2", "--pretok", "--stream-interval", "2", "--same-process", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["mode"] == "streaming" and data["requests"] == 6 and data["completion_tokens"] == 18
    for key in ("submit_wall_s", "submit_lag_ms", "add_request_ms", "tokenize_ms", "queue_wait_ms",
                "prefill_to_first_token_ms", "ttft_ms", "tpot_ms", "itl_ms", "latency_ms", "throughput_tok_s"):
        assert key in data, key
    assert data["compare"][0]["engine"] == "fake_s04" and data["compare"][0]["mode"] == "streaming"
    assert data["correctness"]["equal"] is True and data["config"]["pretok"] is True
    # 3 runs x 2 engines, each on a fresh manager, every one closed.
    assert len(FakeManager.instances) == 6 and all(m.closed for m in FakeManager.instances)
    text = capsys.readouterr().out
    assert "Submit interval/schedule: 5.000 ms / absolute" in text
    assert "Pretok: True" in text and "Stream interval: 2" in text and "Submit lag p50/p95/p99:" in text
    assert "Queue wait (post-tok) p50/p95/p99:" in text


def test_compare_with_a_stage_without_manager_falls_back_to_offline(fake_streaming_stages, capsys):
    from common.bench.harness import run_stage_bench

    result = run_stage_bench("fake_s04", ["--compare", "--warmup-runs", "0", "--repeat-runs", "1", "--same-process"])
    assert result["mode"] == "offline" and result["compare"][0]["engine"] == "fake_s03"
    assert "submit_lag_ms" not in result
    assert "fake_s03 has no SchedulerManager: every engine runs through offline generate()" in capsys.readouterr().out


# ----------------------------------------------------------------------------- late arrivals

class RecordingManager(FakeManager):
    """The fake manager, noting which prompt each add_request call carried and when."""

    def __init__(self, engine, **kwargs) -> None:
        super().__init__(engine, **kwargs)
        self.calls: list[tuple[str, float]] = []

    def add_request(self, prompt=None, **kwargs) -> FakeHandle:
        self.calls.append((prompt, time.perf_counter()))
        return super().add_request(prompt, **kwargs)


def test_late_requests_are_submitted_no_earlier_than_planned_and_in_planned_order():
    # Late ones placed first and out of order in the list: submission follows planned time.
    reqs = [Request(prompt="late 60", params=SamplingParams(max_new_tokens=2), submit_offset_s=0.060),
            *_requests(3),
            Request(prompt="late 30", params=SamplingParams(max_new_tokens=2), submit_offset_s=0.030)]
    manager = RecordingManager(FakeEngine(_loaded()))
    before = time.perf_counter()
    try:
        summary, completions = run_streaming_once(manager, reqs, submit_interval_ms=5.0)
    finally:
        manager.close()
    order = [prompt for prompt, _ in manager.calls]
    assert order == ["Hello #0", "Hello #1", "Hello #2", "late 30", "late 60"]
    at = dict(manager.calls)
    assert at["late 30"] - before >= 0.030 and at["late 60"] - before >= 0.060
    assert at["Hello #2"] - before >= 0.010  # the others keep their 5 ms slots (0, 1, 2) from t0 >= before
    assert [c.prompt for c in completions] == [r.prompt for r in reqs]  # results stay in request order
    assert summary["late_requests"] == 2 and set(summary["on_schedule_itl_ms"]) == {"p50", "p95", "p99"}
    assert summary["submit_lag_ms"]["p50"] >= 0.0


def test_a_stages_manager_gets_the_late_long_prompts_late(tiny):
    from common import stages as registry
    from common.bench.knobs import accepted
    from common.bench.workloads import build_workload

    module = registry.load_stage(registry.newest_available_stage())
    reqs = build_workload(tiny.tokenizer, num_requests=3, prompt_len_range=(8, 16), max_new_tokens=4,
                          stop_on_eos=False, long_prompts=2, long_prompt_len=40, long_prompt_interval_ms=40.0)
    engine = module.InferenceEngine(tiny, max_batch_size=8)
    cls = module.SchedulerManager
    manager = cls(engine, **accepted(cls, {"max_batch_size": 8, "record_token_timestamps": True}))
    before = time.perf_counter()
    try:
        summary, completions = run_streaming_once(manager, reqs)
    finally:
        manager.close()
    for r, c in zip(reqs[3:], completions[3:]):
        assert c.timings["submitted"] - before >= r.submit_offset_s
        assert c.prompt_token_ids == r.prompt_token_ids and len(c.token_ids) == 4
    assert summary["requests"] == 5 and summary["late_requests"] == 2
    # A consumer holds a token only after the worker sampled it: received TTFT >= sampled TTFT, p by p.
    assert all(summary["ttft_received_ms"][p] >= summary["ttft_ms"][p] for p in ("p50", "p95", "p99"))
    offline = module.InferenceEngine(tiny, max_batch_size=8).generate(reqs)  # ignores the offsets
    assert [c.token_ids for c in completions] == [c.token_ids for c in offline]
