"""The offline benchmark harness, its report, workloads and the HF baseline.

Fake engines (defined here) keep these tests independent of any stage and fast; only the HF
baseline test loads a model (`tiny`) because its whole point is parity with transformers.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from common import stages as registry
from common.bench import report
from common.requests import Completion, SamplingParams
from common.bench.workloads import build_workload


class FakeTokenizer:
    """Characters <-> ids 1000+ord(c); ids 0-2 are special."""

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


def fake_model(hidden: int = 8, layers: int = 2, vocab: int = 32) -> types.SimpleNamespace:
    """Just what common/bench/floor.py reads: one Llama-shaped block of projections per layer and an lm_head."""
    shapes = {"qkv": (3 * hidden, hidden), "o": (hidden, hidden), "gate_up": (4 * hidden, hidden),
              "down": (hidden, 2 * hidden)}

    def block() -> types.SimpleNamespace:
        weights = {name: torch.randn(*shape) for name, shape in shapes.items()}
        return types.SimpleNamespace(PROJECTIONS=tuple(shapes), packed={}, unpacked_rows={},
                                     projection=lambda name: (weights[name], None))
    return types.SimpleNamespace(layers=[block() for _ in range(layers)], lm_head_weight=torch.randn(vocab, hidden),
                                 lm_head_packed=None, lm_head_unpacked_rows=0, unpacked_rows={})


def fake_loaded():
    config = types.SimpleNamespace(max_position_embeddings=512, eos_token_ids=(2,))
    return types.SimpleNamespace(name="fake", path=Path("/nonexistent"), tokenizer=FakeTokenizer(), config=config,
                                 device=torch.device("cpu"), dtype=torch.float32, dtype_reason="asked: float32",
                                 model=fake_model())


class FakeEngine:
    """Deterministic tokens from the prompt; synthetic timestamps 1 ms apart."""

    offset = 0  # a subclass with another offset produces different tokens

    def __init__(self, loaded, max_batch_size: int = 8) -> None:
        self.loaded, self.max_batch_size = loaded, max_batch_size

    def generate(self, requests):
        t0 = time.perf_counter()
        out = []
        for r in requests:
            r.validate()
            ids = r.prompt_token_ids or self.loaded.tokenizer.encode(r.prompt)
            toks = [100 + (sum(ids) + k + self.offset) % 97 for k in range(r.params.max_new_tokens)]
            stamps = [t0 + 0.001 * (k + 1) for k in range(len(toks))]
            out.append(Completion(prompt_token_ids=list(ids), token_ids=toks, text="x", finish_reason="length",
                                  token_timestamps=stamps, timings={"submitted": t0}, prompt=r.prompt))
        return out

    def kv_stats(self) -> dict:
        return {"peak_kv_bytes": 2**20}


class PagedFakeEngine(FakeEngine):
    """Takes a stage-03 knob, to check knobs reach only engines that accept them."""

    seen: list[dict] = []

    def __init__(self, loaded, max_batch_size: int = 8, block_size: int = 16) -> None:
        super().__init__(loaded, max_batch_size)
        PagedFakeEngine.seen.append({"block_size": block_size})


class WrongEngine(FakeEngine):
    offset = 1


@pytest.fixture
def fake_stages(monkeypatch):
    """Two fake stages registered as stages 1 and 2, and a fake load_model / HF baseline."""
    import common.bench.hf_baseline
    import common.loader

    def add(name: str, engine, bench: dict | None = None) -> types.ModuleType:
        module = types.ModuleType(name)
        module.InferenceEngine = engine
        if bench is not None:
            module.BENCH = bench
        monkeypatch.setitem(sys.modules, name, module)
        return module

    modules = {"first": add("fake_s01", FakeEngine), "second": add("fake_s02", PagedFakeEngine,
                                                                    {"num_requests": 5, "max_new_tokens": 3})}
    monkeypatch.setattr(registry, "STAGES", {1: "fake_s01", 2: "fake_s02"})
    monkeypatch.setattr(common.loader, "load_model", lambda *a, **k: fake_loaded())
    monkeypatch.setattr(common.bench.hf_baseline, "HFGenerateEngine", FakeEngine)
    PagedFakeEngine.seen = []
    return modules


# ----------------------------------------------------------------------------- report

PCT = {"p50": 1.0, "p95": 2.0, "p99": 3.0}


def test_report_prints_the_posts_lines():
    summary = {"requests": 32, "prompt_tokens": 128, "completion_tokens": 256, "submit_wall_s": 0.082981,
               "submit_interval_ms": 20.0, "submit_schedule": "absolute", "submit_lag_ms": PCT,
               "add_request_ms": {"p50": 0.03, "p95": 0.11, "p99": 53.13}, "tokenize_ms": PCT, "queue_wait_ms": PCT,
               "prefill_to_first_token_ms": PCT, "ttft_ms": {"p50": 140.34, "p95": 255.57, "p99": 255.68},
               "tpot_ms": {"p50": 105.36, "p95": 107.14, "p99": 110.48}, "itl_ms": PCT, "latency_ms": PCT,
               "throughput_tok_s": {"completion": 246.2, "total": 262.0}}
    text = report.format_report(summary, {"Model": "gpt2", "Device": "cpu", "Pretok": True, "Skipped": None})
    assert text.splitlines() == [
        "=== streaming benchmark ===",
        "Model: gpt2",
        "Device: cpu",
        "Pretok: True",
        "Requests: 32",
        "Prompt tokens (total): 128",
        "Completion tokens (total): 256",
        "Submit wall: 0.082981 s",
        "Submit interval/schedule: 20.000 ms / absolute",
        "Submit lag p50/p95/p99: 1.00/2.00/3.00 ms",
        "add_request latency p50/p95/p99: 0.03/0.11/53.13 ms",
        "Tokenize p50/p95/p99: 1.00/2.00/3.00 ms",
        "Queue wait (post-tok) p50/p95/p99: 1.00/2.00/3.00 ms",
        "Prefill->first token p50/p95/p99: 1.00/2.00/3.00 ms",
        "TTFT p50/p95/p99: 140.34/255.57/255.68 ms",
        "TPOT p50/p95/p99: 105.36/107.14/110.48 ms/token",
        "ITL p50/p95/p99: 1.00/2.00/3.00 ms",
        "Latency p50/p95/p99: 1.00/2.00/3.00 ms",
        "Throughput (completion,total): 246.20/262.00 tokens/s",
    ]


def test_offline_report_has_no_submit_or_queue_lines():
    summary = {"requests": 2, "prompt_tokens": 4, "completion_tokens": 8, "ttft_ms": PCT, "tpot_ms": PCT,
               "itl_ms": PCT, "latency_ms": PCT, "throughput_tok_s": {"completion": 10.0, "total": 15.0}}
    runs = [{"throughput_tok_s": {"completion": x}} for x in (9.0, 10.0, 11.0)]
    text = report.format_report(summary, {"Model": "m"}, runs=runs)
    assert "Submit" not in text and "Queue" not in text and "add_request" not in text
    assert "Runs: 3 (medians above; completion tokens/s per run: 9.00, 10.00, 11.00; spread 20.0%)" in text


def test_comparison_ratios_favour_the_first_engine():
    def result(name, tput, ttft, runs):
        return {"engine": name, "throughput_tok_s": {"completion": tput, "total": tput}, "ttft_ms": {"p50": ttft},
                "runs": [{"throughput_tok_s": {"completion": x}} for x in runs]}

    results = [result("s02", 200.0, 50.0, [190, 210]), result("s01", 100.0, 100.0, [95, 105]),
               result("hf", 190.0, 55.0, [180, 205])]
    ratios = report.comparison_ratios(results)
    assert ratios["s01"]["throughput_completion"] == pytest.approx(2.0)
    assert ratios["s01"]["ttft_p50"] == pytest.approx(2.0)  # half the TTFT counts as 2x better
    table = report.format_comparison(results)
    assert "s02 vs s01" in table and "2.00x" in table
    assert "speedup 2.00x (outside the run-to-run spread)" in table
    assert "s02 vs hf: completion throughput speedup 1.05x (within the noise:" in table


# ----------------------------------------------------------------------------- workloads

def test_unique_prompts_get_a_suffix():
    reqs = build_workload(FakeTokenizer(), prompt="Hi", num_requests=3, unique_prompts=True, max_new_tokens=4)
    assert [r.prompt for r in reqs] == ["Hi #0", "Hi #1", "Hi #2"]
    assert all(r.prompt_token_ids is None and r.params.max_new_tokens == 4 and r.params.greedy for r in reqs)


def test_random_lengths_in_range_and_reproducible():
    kwargs = dict(num_requests=20, prompt_len_range=(5, 9), max_new_tokens=2)
    a = build_workload(FakeTokenizer(), seed=3, **kwargs)
    b = build_workload(FakeTokenizer(), seed=3, **kwargs)
    c = build_workload(FakeTokenizer(), seed=4, **kwargs)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert all(5 <= len(r.prompt_token_ids) <= 9 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 1
    assert all(1000 <= t < 5000 for r in a for t in r.prompt_token_ids)  # no special / low / added ids


def test_long_every_and_eos_flag():
    reqs = build_workload(FakeTokenizer(), num_requests=9, max_new_tokens=10, long_every=4, long_max_new_tokens=100,
                          stop_on_eos=False)
    assert [r.params.max_new_tokens for r in reqs] == [100, 10, 10, 10, 100, 10, 10, 10, 100]
    assert not any(r.params.stop_on_eos for r in reqs)


def test_pretok_base_token_ids_same_ids_different_text():
    reqs = build_workload(FakeTokenizer(), prompt="Hello", num_requests=3, unique_prompts=True, max_new_tokens=1,
                          pretok=True, pretok_base_token_ids=True)
    assert len({r.prompt for r in reqs}) == 3
    assert all(r.prompt_token_ids == FakeTokenizer().encode("Hello") for r in reqs)
    plain = build_workload(FakeTokenizer(), prompt="Hello", num_requests=2, unique_prompts=True, max_new_tokens=1,
                           pretok=True)
    assert plain[0].prompt_token_ids != plain[1].prompt_token_ids
    with pytest.raises(ValueError, match="^pretok_base_token_ids"):
        build_workload(FakeTokenizer(), num_requests=1, max_new_tokens=1, pretok_base_token_ids=True)


def test_shared_prefix_and_repeats():
    reqs = build_workload(FakeTokenizer(), num_requests=6, prompt_len_range=(12, 20), shared_prefix_len=8,
                          repeat_prompts=2, max_new_tokens=1)
    prefixes = {tuple(r.prompt_token_ids[:8]) for r in reqs}
    assert len(prefixes) == 1
    ids = [tuple(r.prompt_token_ids) for r in reqs]
    assert ids[0] == ids[1] and ids[2] == ids[3] and len(set(ids)) == 3
    with pytest.raises(ValueError, match="^num_requests"):
        build_workload(FakeTokenizer(), num_requests=0, max_new_tokens=1)
    # A length counts the prefix: 8 tokens of prefix and lengths 4-20 would cut some prompts to 9 tokens
    with pytest.raises(ValueError, match=r"^prompt_len_range: \(4, 20\) counts the shared prefix of 8"):
        build_workload(FakeTokenizer(), num_requests=2, prompt_len_range=(4, 20), shared_prefix_len=8, max_new_tokens=1)
    with pytest.raises(ValueError, match="^long_max_new_tokens: only used with long_every"):
        build_workload(FakeTokenizer(), num_requests=2, long_max_new_tokens=9, max_new_tokens=1)


def test_long_prompts_arrive_late_after_the_others():
    plain = build_workload(FakeTokenizer(), num_requests=3, prompt_len_range=(4, 8), max_new_tokens=5, seed=1)
    reqs = build_workload(FakeTokenizer(), num_requests=3, prompt_len_range=(4, 8), max_new_tokens=5, seed=1,
                          long_prompts=2, long_prompt_len=12, long_prompt_interval_ms=250.0)
    assert len(reqs) == 5
    assert [r.submit_offset_s for r in reqs] == [None, None, None, 0.25, 0.5]
    assert [r.prompt_token_ids for r in reqs[:3]] == [r.prompt_token_ids for r in plain]  # the others unchanged
    late = reqs[3:]
    assert all(len(r.prompt_token_ids) == 12 and r.params.max_new_tokens == 5 for r in late)
    assert late[0].prompt_token_ids != late[1].prompt_token_ids
    assert all(1000 <= t < 5000 for r in late for t in r.prompt_token_ids)  # ordinary ids only
    assert all(r.submit_offset_s is None for r in build_workload(FakeTokenizer(), num_requests=2, max_new_tokens=1))


@pytest.mark.parametrize("kwargs, field", [
    ({"long_prompts": -1}, "long_prompts"),
    ({"long_prompts": 1, "long_prompt_len": 0}, "long_prompt_len"),
    ({"long_prompts": 1, "long_prompt_interval_ms": -5.0}, "long_prompt_interval_ms"),
])
def test_bad_long_prompt_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        build_workload(FakeTokenizer(), num_requests=1, max_new_tokens=1, **kwargs)


def test_submit_offset_is_validated_and_in_the_workload_digest():
    from common.bench.workloads import workload_digest
    from common.requests import Request

    with pytest.raises(ValueError, match="^submit_offset_s"):
        Request(prompt="Hi", submit_offset_s=-0.1).validate()
    Request(prompt="Hi", submit_offset_s=0.0).validate()
    reqs = build_workload(FakeTokenizer(), num_requests=2, max_new_tokens=1, long_prompts=1, long_prompt_len=3)
    moved = copy.deepcopy(reqs)
    moved[-1].submit_offset_s = 4.0
    assert workload_digest(reqs) == workload_digest(copy.deepcopy(reqs))
    assert workload_digest(reqs) != workload_digest(moved)


def test_describe_workload_names_the_late_prompts():
    from common.bench.flags import build_parser, describe_workload

    args = build_parser("bench").parse_args(["--long-prompts", "4", "--long-prompt-len", "2000",
                                             "--long-prompt-interval-ms", "2000"])
    assert "4 late prompts of 2000 random tokens, one every 2000 ms" in describe_workload(args)
    assert "late" not in describe_workload(build_parser("bench").parse_args([]))


# ----------------------------------------------------------------------------- harness

def test_bench_json_has_every_field(fake_stages, tmp_path, capsys):
    from common.bench.harness import run_stage_bench

    out = tmp_path / "sub" / "out.json"
    run_stage_bench("fake_s02", ["--compare", "--baseline", "hf", "--warmup-runs", "1", "--repeat-runs", "2",
                                 "--block-size", "32", "--same-process", "--json", str(out)])
    data = json.loads(out.read_text())
    for key in ("stage", "model", "device", "dtype", "dtype_reason", "config", "env", "requests", "prompt_tokens",
                "completion_tokens", "wall_s", "throughput_tok_s", "kv", "runs", "compare", "ratios", "correctness",
                "decode_step_ms", "floor_ms", "floor_batch", "x_floor", "process"):
        assert key in data, key
    assert data["stage"] == "fake_s02" and data["model"] == "fake" and data["device"] == "cpu"
    assert data["requests"] == 5 and data["completion_tokens"] == 15  # BENCH defaults
    assert set(data["throughput_tok_s"]) == {"completion", "total"}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
        assert set(data[key]) == {"p50", "p95", "p99"}, key
    assert data["config"]["block_size"] == 32 and data["config"]["compare"] is True
    assert {"git_commit", "git_dirty", "torch", "transformers", "device_name", "cpu_model", "cpu_capability",
            "torch_threads", "cpu_count"} <= set(data["env"])
    assert len(data["runs"]) == 2 and data["kv"] == {"peak_kv_bytes": 2**20}
    assert [c["engine"] for c in data["compare"]] == ["fake_s01", "hf_generate"]
    assert data["decode_step_ms"] == pytest.approx(1.0) and data["floor_batch"] == 5 and data["floor_ms"] > 0
    assert data["x_floor"] == pytest.approx(data["decode_step_ms"] / data["floor_ms"])
    assert data["process"]["fresh_process"] is False and data["process"]["engines_in_process"] == 3
    assert data["config"]["same_process"] is True
    for entry in data["compare"]:
        assert {"throughput_tok_s", "ttft_ms", "runs", "requests", "x_floor"} <= set(entry)
    assert set(data["ratios"]) == {"fake_s01", "hf_generate"}
    assert data["correctness"] == {"checked": True, "equal": True, "mismatches": {}}
    assert PagedFakeEngine.seen and all(s == {"block_size": 32} for s in PagedFakeEngine.seen)
    text = capsys.readouterr().out
    assert text.count("=== streaming benchmark ===") == 3
    assert "=== warmup 1/1 ===" in text and "=== run 2/2 ===" in text
    assert "fake_s01 takes no block_size" in text  # knob not offered to an engine without it
    assert "=== comparison" in text and "fake_s02 vs fake_s01" in text
    assert "Decode step (ms): 1.00" in text and "Matmul floor at batch 5 (ms):" in text and "x floor:" in text
    assert "Process: shared, engines alternating" in text
    assert data["matmul_unpacked_rows"] == {} and "F.linear at few rows" not in text  # all packed: no line


def test_the_floor_lines_name_the_projections_that_take_f_linear_at_few_rows() -> None:
    from common.bench.report import floor_lines

    lines = floor_lines({"floor_ms": 2.0, "floor_batch": 1, "matmul_unpacked_rows": {"qkv": 3, "gate_up": 0, "lm_head": 1}})
    assert lines[-1] == "F.linear at few rows (measured at load, packed above): qkv <= 3, lm_head <= 1"
    assert not any("F.linear" in line for line in floor_lines({"floor_ms": 2.0, "matmul_unpacked_rows": {"qkv": 0}}))


def test_token_mismatch_is_reported_not_fatal(fake_stages, capsys):
    from common.bench.harness import run_stage_bench

    fake_stages["first"].InferenceEngine = WrongEngine
    result = run_stage_bench("fake_s02", ["--compare", "--warmup-runs", "0", "--repeat-runs", "1", "--same-process"])
    assert result["correctness"]["equal"] is False
    assert result["correctness"]["mismatches"]["fake_s01"]["request"] == 0
    assert "WARNING: token ids differ between fake_s02 and fake_s01 at request 0" in capsys.readouterr().err


def test_flags_override_bench_defaults(fake_stages):
    from common.bench.harness import run_stage_bench

    result = run_stage_bench("fake_s02", ["--num-requests", "2", "--prompt-len-min", "4", "--prompt-len-max", "6",
                                          "--warmup-runs", "0", "--repeat-runs", "1"])
    assert result["requests"] == 2 and result["completion_tokens"] == 6
    assert 8 <= result["prompt_tokens"] <= 12
    assert result["compare"] == [] and result["correctness"] == {"checked": False, "equal": True, "mismatches": {}}
    assert result["floor_batch"] == 2 and result["x_floor"] > 0  # a single stage gets the floor too


def test_offline_bench_says_it_ignores_the_late_arrivals(fake_stages, capsys):
    from common.bench.harness import run_stage_bench

    result = run_stage_bench("fake_s02", ["--long-prompts", "2", "--long-prompt-len", "6", "--warmup-runs", "0",
                                          "--repeat-runs", "1"])
    assert result["requests"] == 7 and result["completion_tokens"] == 21  # 5 + 2 late, 3 tokens each
    assert any("planned arrivals (--long-prompts) are ignored" in n for n in result["notes"])
    assert not any("scheduler manager" in n for n in result["notes"])  # no streaming flag was set
    result = run_stage_bench("fake_s02", ["--warmup-runs", "0", "--repeat-runs", "1", "--stream-interval", "8",
                                          "--submit-interval-ms", "20", "--max-queue-delay-ms", "5"])
    assert ("offline generate() has no scheduler manager, submitter or stream: --stream-interval, "
            "--max-queue-delay-ms, --submit-interval-ms not applied") in result["notes"]


def test_preset_post_052_replaces_the_stages_bench(fake_stages, monkeypatch):
    from common.bench.flags import PRESETS, as_defaults, build_parser, parse_bench_args

    module = fake_stages["second"]  # its BENCH: 5 requests, 3 new tokens, and a workload of its own
    monkeypatch.setitem(module.BENCH, "shared_prefix_len", 500)
    monkeypatch.setitem(module.BENCH, "unique_prompts", True)
    want = as_defaults(PRESETS["post-052"], build_parser("bench"), "post-052")
    args = parse_bench_args(module, ["--preset", "post-052"])
    assert {k: getattr(args, k) for k in want} == want
    no_bench = types.ModuleType("no_bench")
    assert args == parse_bench_args(no_bench, ["--preset", "post-052"])  # whatever the stage's BENCH
    assert args.shared_prefix_len is None and args.unique_prompts is False
    assert args.num_requests == 64 and args.max_new_tokens == 128 and args.submit_interval_ms == 20.0
    assert parse_bench_args(module, []).num_requests == 5  # no preset: the stage's BENCH
    typed = parse_bench_args(module, ["--preset", "post-052", "--num-requests", "7", "--repeat-runs", "1"])
    assert typed.num_requests == 7 and typed.repeat_runs == 1 and typed.max_new_tokens == 128  # flags still win


def test_a_typed_kind_of_prompt_replaces_the_stages_own():
    """Stage 12's BENCH asks for random 16-token prompts with EOS ignored, stage 13's for chat
    questions: `--chat-prompts` on stage 12 runs stage 13's kind (it used to run the random ones
    without a word), `--prompt-len-*` on stage 13 the random ones; both typed is an error."""
    import importlib

    from common.bench.flags import check_args, describe_workload, parse_bench_args

    s12, s13 = (importlib.import_module(f"stages.{name}") for name in ("s12_cuda_graphs", "s13_preemption"))
    chat = parse_bench_args(s12, ["--chat-prompts", "--max-new-tokens", "512"])
    assert chat.chat_prompts and chat.prompt_len_min is None and chat.prompt_len_max is None
    assert chat.no_stop_on_eos is False and describe_workload(chat).endswith("stop on EOS")
    assert parse_bench_args(s12, ["--chat-prompts", "--no-stop-on-eos"]).no_stop_on_eos is True
    assert parse_bench_args(s12, []).prompt_len_min == 16  # nothing typed: the stage's own
    assert parse_bench_args(s12, ["--num-requests", "8"]).no_stop_on_eos is True
    random_ = parse_bench_args(s13, ["--prompt-len-min", "20"])
    check_args(random_)
    assert not random_.chat_prompts and (random_.prompt_len_min, random_.prompt_len_max) == (20, 20)
    assert parse_bench_args(s13, ["--chat-prompts"]).chat_prompts  # the stage's own kind, typed
    with pytest.raises(ValueError, match="^--chat-prompts: cannot go with --prompt-len-min"):
        parse_bench_args(s13, ["--chat-prompts", "--prompt-len-max", "9"])
    s10 = importlib.import_module("stages.s10_block_prefix_cache")  # its BENCH: a 500-token shared prefix
    assert parse_bench_args(s10, ["--chat-prompts"]).shared_prefix_len is None
    with pytest.raises(ValueError, match="^--chat-prompts: cannot go with --shared-prefix-len"):
        parse_bench_args(s10, ["--chat-prompts", "--shared-prefix-len", "8"])
    text = parse_bench_args(s12, ["--prompt", "Tell me a story"])  # a text in place of the random prompts
    assert text.prompt_len_min is None and describe_workload(text).startswith("prompt 'Tell me a story'")
    assert not parse_bench_args(s13, ["--prompt", "Tell me a story"]).chat_prompts
    hello = parse_bench_args(s12, ["--prompt", "Hello"])  # the default's text, typed, counts too
    assert hello.prompt_len_min is None and describe_workload(hello).startswith("prompt 'Hello'")
    assert not parse_bench_args(s13, ["--prompt", "Hello"]).chat_prompts
    for argv, other in ((["--chat-prompts"], "--chat-prompts"), (["--prompt-len-min", "4"], "--prompt-len-min")):
        with pytest.raises(ValueError, match=f"^--prompt: cannot go with {other}"):
            parse_bench_args(s12, ["--prompt", "Tell me a story", *argv])
    with pytest.raises(ValueError, match="^chat_prompts: cannot go with prompt_len_range"):
        build_workload(None, num_requests=2, max_new_tokens=3, chat_prompts=True, prompt_len_range=(4, 8))
    with pytest.raises(ValueError, match="^chat_prompts: cannot go with shared_prefix_len"):
        build_workload(None, num_requests=2, max_new_tokens=3, chat_prompts=True, shared_prefix_len=4)


def test_other_choices_typed_over_the_defaults_and_workload_flags_checked_by_name():
    """A typed prefix cache size over a BENCH's or preset's "off", on each stage whose cache has a
    size (stages 05-09: with --compare, stage 10's block cache stays off and stage 09 gets the
    size); a typed pool size over the BENCH's other one; what build_workload would refuse,
    refused by flag before the model loads."""
    import importlib

    from common.bench.flags import check_args, parse_bench_args
    from common.bench.knobs import accepted, engine_knobs, knobs_not_taken

    s09, s10, s13 = (importlib.import_module(f"stages.{name}") for name in
                     ("s09_batched_worker_lookups", "s10_block_prefix_cache", "s13_preemption"))
    knobs = lambda module, args: accepted(module.InferenceEngine, engine_knobs(args))  # noqa: E731  what it is given
    assert knobs(s09, parse_bench_args(s09, []))["prefix_cache_max_entries"] == 0  # its BENCH: cache off
    sized = parse_bench_args(s10, ["--preset", "post-052", "--compare", "--prefix-cache-max-entries", "64"])
    assert knobs(s09, sized)["prefix_cache_max_entries"] == 64  # the compared stage takes the size
    assert knobs(s10, sized)["enable_prefix_caching"] is False and knobs_not_taken(s10, sized) == ["prefix_cache_max_entries"]
    pool = parse_bench_args(s13, ["--kv-cache-max-concurrency", "8"])  # in place of its BENCH's num_kv_blocks
    assert (pool.kv_cache_max_concurrency, pool.num_kv_blocks) == (8, None)
    assert parse_bench_args(s13, []).num_kv_blocks == 280
    for module, argv, message in ((s10, ["--prompt-len-max", "64"],
                                   "--prompt-len-min/--prompt-len-max: a random prompt's length counts the shared prefix"),
                                  (s09, ["--long-max-new-tokens", "9"], "--long-max-new-tokens: only used with --long-every"),
                                  (s09, ["--long-prompt-len", "500"], "--long-prompt-len: only used with --long-prompts"),
                                  (s13, ["--kv-cache-max-concurrency", "8", "--num-kv-blocks", "64"],
                                   "--num-kv-blocks: cannot go with --kv-cache-max-concurrency")):
        with pytest.raises(ValueError, match=f"^{message}"):  # by flag, before any weights load
            check_args(parse_bench_args(module, argv))
    with pytest.raises(ValueError, match="^--prefix-cache-max-entries: cannot go with --no-prefix-cache"):
        parse_bench_args(s09, ["--prefix-cache-max-entries", "64", "--no-prefix-cache"])


def test_unknown_preset_lists_the_known_ones(fake_stages, capsys):
    from common.bench.flags import parse_bench_args

    with pytest.raises(SystemExit):
        parse_bench_args(fake_stages["second"], ["--preset", "post-999"])
    err = capsys.readouterr().err
    assert "--preset" in err and "post-999" in err and "post-052" in err


def test_post_052_preset_is_stage_09s_bench_and_make_bench_runs_it():
    import importlib

    from common.bench.flags import PRESETS

    assert PRESETS["post-052"] == importlib.import_module("stages.s09_batched_worker_lookups").BENCH
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert ".bench --preset post-052 $(BENCH_ARGS)" in makefile


# ----------------------------------------------------------------------------- registry, cli, env

def test_stage_registry_names():
    assert registry.stage_package(2) == registry.stage_package("02") == "stages.s02_kv_cache"
    assert registry.stage_package("s02_kv_cache") == registry.stage_package("stages.s02_kv_cache")
    assert registry.previous_stage("stages.s02_kv_cache") == "stages.s01_naive_batching"
    assert registry.previous_stage(1) is None
    assert list(registry.STAGES) == list(range(1, len(registry.STAGES) + 1))  # numbered 1..N, no gaps
    with pytest.raises(ValueError, match="^stage"):
        registry.stage_package("s10_nothing")


def test_cli_hands_bench_flags_over_untouched(monkeypatch):
    import common.bench.harness
    from common import cli

    seen = {}
    monkeypatch.setattr(registry, "resolve_stage", lambda stage: f"pkg-{stage}")
    monkeypatch.setattr(common.bench.harness, "run_stage_bench", lambda pkg, argv, prog=None: seen.update(pkg=pkg, argv=argv))
    assert cli.main(["bench", "--num-requests", "4", "--stage", "2", "--prompt", "a b"]) == 0
    assert seen == {"pkg": "pkg-2", "argv": ["--num-requests", "4", "--prompt", "a b"]}


def test_collect_env_fields(monkeypatch):
    import subprocess

    from common.bench.envinfo import REPO_ROOT, collect_env

    def git_says() -> dict:
        """This checkout's commit, and whether tracked files outside docs/results/ have edits, from git itself."""
        def git(*args: str) -> str | None:
            try:
                return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                                      timeout=10, check=True).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                return None  # no git or no repository: the fields must say "unknown" (None)
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
        return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else status != ""}

    monkeypatch.delenv("STAGEWISE_GIT_COMMIT", raising=False)  # a device copy's stand-in: ask git here
    before = git_says()
    env = collect_env("cpu")
    after = git_says()  # (the checkout may change while the tests run: either state is right)
    assert env["device_name"] == "cpu" and env["torch"] == torch.__version__ and env["cpu_count"] >= 1
    # The top-level fields are the state at import; where the checkout has moved since, git_now is now's.
    now = env.get("git_now", {"git_commit": env["git_commit"], "git_dirty": env["git_dirty"]})
    assert now in (before, after), (now, before, after)


# ----------------------------------------------------------------------------- HF baseline

def _greedy_no_eos(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference for stop_on_eos=False: plain argmax loop, full forward each step."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def test_hf_baseline_matches_hf_generate_one_at_a_time(tiny, hf_tiny):
    from common.bench.hf_baseline import HFGenerateEngine
    from conftest import run_hf_greedy

    requests = build_workload(tiny.tokenizer, num_requests=5, prompt_len_range=(3, 30), max_new_tokens=8, seed=7)
    for r, n in zip(requests, [8, 3, 6, 8, 5]):
        r.params.max_new_tokens = n
    # Make a token the model really emits the EOS, so stopping and trimming are exercised.
    first = HFGenerateEngine(tiny, max_batch_size=8).generate(copy.deepcopy(requests))
    eos = first[0].token_ids[2]
    loaded = copy.copy(tiny)
    loaded.config = dataclasses.replace(tiny.config, eos_token_ids=(eos,))
    requests[3].params = SamplingParams(max_new_tokens=8, stop_on_eos=False)  # batch 2 mixes EOS / no-EOS rows

    engine = HFGenerateEngine(loaded, max_batch_size=3)
    got = engine.generate(copy.deepcopy(requests))
    for r, c in zip(requests, got):
        if r.params.stop_on_eos:
            want = run_hf_greedy(hf_tiny, r.prompt_token_ids, r.params.max_new_tokens, [eos])
        else:
            want = _greedy_no_eos(hf_tiny, r.prompt_token_ids, r.params.max_new_tokens)
            assert len(c.token_ids) == r.params.max_new_tokens
        assert c.token_ids == want
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos and r.params.stop_on_eos else "length")
        assert len(c.token_timestamps) == len(c.token_ids)
        assert c.token_timestamps == sorted(c.token_timestamps)
        assert c.timings["submitted"] <= c.timings["first_token"] == c.token_timestamps[0]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 3
    assert engine.kv_stats()["peak_kv_bytes"] > 0


def test_enforce_eager_is_three_way_and_reaches_the_engine_only_when_given() -> None:
    """Unset: the engine picks (graphs on CUDA, eager on a CPU); --enforce-eager and
    --no-enforce-eager reach stage 12+ engines as True and False."""
    from common.bench.flags import build_parser
    from common.bench.knobs import accepted, engine_knobs
    from stages import s12_cuda_graphs as s12

    parser = build_parser("test")
    for argv, want in (([], None), (["--enforce-eager"], True), (["--no-enforce-eager"], False)):
        knobs = accepted(s12.InferenceEngine, engine_knobs(parser.parse_args(argv)))
        assert knobs.get("enforce_eager") is want
