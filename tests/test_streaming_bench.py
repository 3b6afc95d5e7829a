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
                 stream_interval: int = 1, tokenize_workers: int = 0) -> None:
        self.engine, self.stream_interval = engine, stream_interval
        self.tokenizer = engine.loaded.tokenizer
        self.pending: queue.Queue = queue.Queue()
        self.next_id = 0
        self.closed = False
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()
        FakeManager.instances.append(self)

    def add_request(self, prompt=None, *, prompt_token_ids=None, params=None) -> FakeHandle:
        submitted = time.perf_counter()
        handle = FakeHandle(self.next_id)
        self.next_id += 1
        self.pending.put((handle, prompt, prompt_token_ids, params or SamplingParams(), submitted))
        return handle

    def _work(self) -> None:
        while (item := self.pending.get()) is not None:
            handle, prompt, ids, params, submitted = item
            try:
                params.validate()
                tokenized = time.perf_counter()
                ids = list(ids) if ids is not None else self.tokenizer.encode(prompt)
                scheduled = time.perf_counter()
                toks, stamps = [], []
                for k in range(params.max_new_tokens):
                    time.sleep(0.0005)
                    toks.append(100 + (sum(ids) + k) % 50)
                    stamps.append(time.perf_counter())
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
                                 device=torch.device("cpu"), dtype=torch.float32, model=fake_model())


def _requests(n: int, max_new_tokens: int = 2) -> list[Request]:
    return [Request(prompt=f"Hello #{i}", params=SamplingParams(max_new_tokens=max_new_tokens)) for i in range(n)]


def test_absolute_schedule_submits_on_time():
    manager = FakeManager(FakeEngine(_loaded()))
    try:
        summary, completions = run_streaming_once(manager, _requests(8), submit_interval_ms=20.0,
                                                  submit_schedule="absolute")
    finally:
        manager.close()
    # 8 requests every 20 ms: the last one is due 140 ms after the first, not later.
    assert 0.138 <= summary["submit_wall_s"] < 0.200
    assert summary["submit_lag_ms"]["p50"] < 5.0
    assert summary["submit_interval_ms"] == 20.0 and summary["submit_schedule"] == "absolute"
    assert summary["add_request_ms"]["p99"] < 20.0
    assert summary["requests"] == 8 and summary["completion_tokens"] == 16
    for key in ("tokenize_ms", "queue_wait_ms", "prefill_to_first_token_ms", "ttft_ms", "itl_ms"):
        assert key in summary, key
    starts = sorted(c.timings["submitted"] for c in completions)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.020, abs=0.004), gaps


def test_relative_schedule_waits_after_each_call():
    manager = FakeManager(FakeEngine(_loaded()))
    try:
        summary, _ = run_streaming_once(manager, _requests(4), submit_interval_ms=10.0, submit_schedule="relative")
    finally:
        manager.close()
    assert summary["submit_wall_s"] >= 0.030 and summary["submit_schedule"] == "relative"


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
    from common.bench.flags import accepted
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
