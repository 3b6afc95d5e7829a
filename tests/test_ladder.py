"""`stagewise ladder` (common/bench/ladder.py): one small run on the tiny model, and its pieces.

Why: the ladder is the picture the docs lead with, so its files must exist with the fields the
docs hook reads (`entries[].throughput_tok_s`, `ttft_ms`, `tpot_ms`, `kv.peak_kv_bytes`), the
PNG must be a real image, and the correctness check must run before any number is trusted.
"""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest

from common import stages as registry
from common.bench import ladder, ladder_rungs, ladder_workloads

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("ladder")
    argv = ["--model", "tiny", "--device", "cpu", "--out", str(out), "--num-requests", "4", "--max-new-tokens", "4",
            "--warmup-runs", "0", "--repeat-runs", "1", "--stages", "1,2,4"]
    return out, ladder.run_ladder(argv), " ".join(argv)


def test_small_ladder_writes_table_json_and_png(small_run, capsys) -> None:
    out, data, _ = small_run
    for suffix in ("json", "png", "txt"):
        assert (out / f"ladder.cpu.{suffix}").is_file()
    width, height = png_size(out / "ladder.cpu.png")
    assert width > 300 and height > 100
    on_disk = json.loads((out / "ladder.cpu.json").read_text())
    assert on_disk["command"].startswith("stagewise ladder --model tiny")
    for key in ("env", "config", "workload", "correctness", "entries", "skipped", "notes"):
        assert key in on_disk, key
    assert on_disk["env"]["git_commit"] is None or len(on_disk["env"]["git_commit"]) == 40
    assert on_disk["workload"]["requests"] == 4
    table = (out / "ladder.cpu.txt").read_text()
    assert "=== ladder: tiny" in table and "TTFT p50" in table


def test_every_engine_has_the_fields_the_docs_read(small_run) -> None:
    _, data, _ = small_run
    names = [e["engine"] for e in data["entries"]]
    assert names[:3] == ["s01_naive_batching", "s02_kv_cache", "s04_online_scheduler"]
    assert "hf_generate" in names
    for e in data["entries"]:
        for group, key in (("throughput_tok_s", "completion"), ("throughput_tok_s", "total"), ("ttft_ms", "p50"),
                           ("ttft_ms", "p99"), ("tpot_ms", "p50")):
            assert isinstance(e[group][key], float), (e["engine"], group, key)
        assert "peak_kv_bytes" in e["kv"]
        assert len(e["runs"]) == 1 and e["mode"] == "offline"
        assert e["tokens_match_stage1"] is True, e["engine"]
        assert e["process"]["fresh_process"] is True and e["process"]["exit_code"] == 0, e["engine"]
        assert e["floor_batch"] == 4 and e["floor_ms"] > 0 and e["x_floor"] > 0, e["engine"]
    assert len({e["process"]["pid"] for e in data["entries"]}) == len(data["entries"])  # one process each
    assert data["correctness"] == {"checked": True, "reference": "s01_naive_batching", "equal": True,
                                   "mismatches": {}}
    cb = [e for e in data["entries"] if e["engine"] == "hf_continuous_batching"]
    skipped = [s for s in data["skipped"] if s["engine"] == "hf_continuous_batching"]
    assert len(cb) + len(skipped) == 1  # ran, or says why not
    from common.bench import hf_continuous
    if hf_continuous.available(None)[0]:  # this transformers has it: then it must have run, not failed
        assert cb, skipped
    assert all(s["reason"] for s in data["skipped"])


def test_the_docs_hook_renders_the_ladder_json(small_run) -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "hooks"))
    import stagewise as hook

    out, _, _ = small_run
    md = hook.render_ladder_table(out.parent, f"{out.name}/ladder.cpu.json", "ladder.md")
    assert "| `s01_naive_batching` |" in md and "| `s04_online_scheduler` |" in md


def _args(**kw) -> argparse.Namespace:
    base = dict(workload="default", num_requests=None, max_new_tokens=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_workloads_fit_the_context_window() -> None:
    notes: list[str] = []
    kw = ladder_workloads.workload_kwargs(_args(workload="random-lengths"), 128, notes)
    assert kw["prompt_len_range"][1] + kw["max_new_tokens"] <= 128 and notes
    kw = ladder_workloads.workload_kwargs(_args(workload="mixed-output"), 128, [])
    assert kw["long_max_new_tokens"] <= 64 and kw["max_new_tokens"] >= 1
    kw = ladder_workloads.workload_kwargs(_args(workload="default", num_requests=3, max_new_tokens=2), 8192, [])
    assert kw["num_requests"] == 3 and kw["max_new_tokens"] == 2 and kw["long_max_new_tokens"] == 8
    assert ladder_workloads.workload_kwargs(_args(workload="burst"), 8192, [])["num_requests"] == 32


def test_shared_prefix_and_long_prompts_workloads(tiny) -> None:
    from common.bench.workloads import build_workload

    kw = ladder_workloads.workload_kwargs(_args(workload="shared-prefix"), 8192, notes := [])
    assert kw["shared_prefix_len"] == 500 and kw["num_requests"] == 32 and kw["max_new_tokens"] == 32 and not notes
    kw = ladder_workloads.workload_kwargs(_args(workload="long-prompts"), 8192, notes)
    assert (kw["long_prompts"], kw["long_prompt_len"], kw["long_prompt_interval_ms"]) == (4, 2000, 2000.0)
    assert kw["num_requests"] == 16 and kw["prompt_len_range"] == (64, 128) and kw["max_new_tokens"] == 96
    assert not notes
    for name in ("shared-prefix", "long-prompts"):
        assert ladder_rungs.parse_args(["--workload", name, "--out", "/tmp/x"]).max_batch_size == 16
        assert ladder_workloads.WORKLOADS[name][0]  # says what it shows

    limit = tiny.config.max_position_embeddings  # 128: everything must be cut to fit
    kw = ladder_workloads.workload_kwargs(_args(workload="long-prompts"), limit, notes := [])
    assert kw["long_prompt_len"] + kw["max_new_tokens"] <= limit
    assert kw["prompt_len_range"][1] + kw["max_new_tokens"] <= limit and any("long prompts" in n for n in notes)
    reqs = build_workload(tiny.tokenizer, **kw)
    assert len(reqs) == 20 and [r.submit_offset_s for r in reqs[16:]] == [2.0, 4.0, 6.0, 8.0]
    assert all(len(r.prompt_token_ids) + r.params.max_new_tokens <= limit for r in reqs)
    assert "4 late prompts" in ladder_workloads.describe("long-prompts", kw)

    kw = ladder_workloads.workload_kwargs(_args(workload="shared-prefix", num_requests=4), limit, notes := [])
    reqs = build_workload(tiny.tokenizer, **kw)
    assert any("shared prefix" in n for n in notes) and "shared prefix" in ladder_workloads.describe("shared-prefix", kw)
    assert all(len(r.prompt_token_ids) + r.params.max_new_tokens <= limit for r in reqs)
    assert len({tuple(r.prompt_token_ids[:kw["shared_prefix_len"]]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 4  # distinct questions


def test_stage_subset_parsing() -> None:
    assert ladder_rungs.parse_stages("1, 2,4") == [1, 2, 4]
    assert ladder_rungs.parse_stages("9,10") == [9, 10]  # the rungs the shared-prefix and long-prompts workloads compare
    assert ladder_rungs.parse_stages(None) == sorted(registry.STAGES)  # every stage, 01 to the newest
    with pytest.raises(ValueError, match="^stage: no stage 42"):
        ladder_rungs.parse_stages("1,42")


def test_max_num_batched_tokens_reaches_only_the_stages_that_take_it(tiny, tmp_path) -> None:
    """--max-num-batched-tokens (vLLM's name) sets the step budget of stages 11+; an earlier
    stage, whose constructor has no such knob, is built as before, and the default stays each
    stage's own."""
    setup = ladder_rungs.Setup(tiny, [], {}, 32)
    for argv, budget in ((["--max-num-batched-tokens", "96"], 96), ([], None)):
        args = ladder_rungs.parse_args(["--out", str(tmp_path), "--max-batch-size", "4", *argv])
        s10, s11 = [e.factory() for e in ladder_rungs.build_engines(args, setup, [10, 11], hf=False, notes=[], skipped=[])]
        assert not hasattr(s10, "max_num_batched_tokens") and s10.pool.allocator.num_blocks == 32
        assert s11.max_num_batched_tokens == (budget or registry.load_stage(11).engine.DEFAULT_MAX_NUM_BATCHED_TOKENS)


def test_report_redraws_table_and_chart_from_the_json_alone(small_run, tmp_path) -> None:
    from common.bench import ladder_report

    out, data, _ = small_run
    copy = tmp_path / "ladder.cpu.json"
    copy.write_text((out / "ladder.cpu.json").read_text())
    assert ladder_report.main([str(copy)]) == 0
    assert (tmp_path / "ladder.cpu.txt").read_text() == (out / "ladder.cpu.txt").read_text()
    assert png_size(tmp_path / "ladder.cpu.png")[0] > 300


@pytest.mark.parametrize("dtype, fails", [("float32", ["s03_paged_attention"]), ("bfloat16", [])])
def test_a_token_difference_fails_the_ladder_in_fp32_only(dtype, fails) -> None:
    """On the H200 a bf16 ladder of `gpt2-random` (whose logits are near-ties everywhere) exited 1
    on stages whose fp32 tokens all equal transformers': in bf16 a difference is rounding."""
    data = {"dtype": dtype, "skipped": [],
            "correctness": {"mismatches": {"s03_paged_attention": {}, "hf_generate": {}}}}
    assert ladder.failed_engines(data) == fails
    data["skipped"] = [{"engine": "s09_batched_worker_lookups", "reason": "crashed"}]
    assert ladder.failed_engines(data) == ["s09_batched_worker_lookups", *fails]  # a crash fails in any dtype


def _three_prompts() -> tuple[list[list[int]], list]:
    """Three prompts of token ids, 31 tokens in all, and their greedy requests (3 new tokens each)."""
    from common.requests import Request, SamplingParams

    prompts = [[100 + i for i in range(n)] for n in (5, 9, 17)]
    return prompts, [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=3, stop_on_eos=False))
                     for p in prompts]


def test_a_rungs_kv_counters_are_its_last_runs(tiny) -> None:
    """A rung's engine serves its warmup and every repeat: its counters (prefix-cache queries,
    preemptions, ...) would add up over all of them; the entry keeps one run's, as the bench does."""
    stage = registry.load_stage("stages.s10_block_prefix_cache")
    rung = ladder_rungs.Engine("s10", "s10", lambda: stage.InferenceEngine(tiny, max_batch_size=4))
    prompts, requests = _three_prompts()
    ladder_rungs.run_all([rung], requests, argparse.Namespace(warmup_runs=1, repeat_runs=2))
    assert rung.error is None and len(rung.summaries) == 2
    assert rung.kv["prefix_cache_query_tokens"] == sum(map(len, prompts))  # one run's prompts, not three runs'
    assert rung.engine.kv_stats()["prefix_cache_query_tokens"] == 3 * sum(map(len, prompts))


def test_the_bench_with_a_reused_engine_keeps_its_last_runs_kv_counters(tiny) -> None:
    from common.bench import engines

    stage = registry.load_stage("stages.s10_block_prefix_cache")
    spec = engines.EngineSpec("s10", lambda: stage.InferenceEngine(tiny, max_batch_size=4))
    prompts, requests = _three_prompts()
    engines.run_engines([spec], lambda s: engines.run_offline_once(s, requests), requests, 1, 2, fresh_engine=False)
    assert spec.kv["prefix_cache_query_tokens"] == sum(map(len, prompts))
