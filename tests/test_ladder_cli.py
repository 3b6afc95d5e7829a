"""`stagewise ladder`: every stage (and transformers) on one workload, one process, table + JSON + PNG."""

from __future__ import annotations

import json

from common.cli import main as stagewise


def test_ladder_on_tiny_writes_table_json_and_png(tmp_path, capsys):
    stagewise(["ladder", "--model", "tiny", "--out", str(tmp_path), "--stages", "1,2,4",
               "--num-requests", "4", "--max-new-tokens", "3", "--warmup-runs", "0", "--repeat-runs", "1"])
    table = capsys.readouterr().out
    for name in ("s01_naive_batching", "s02_kv_cache", "s04_online_scheduler", "hf_generate"):
        assert name in table
    result = json.loads((tmp_path / "ladder.cpu.json").read_text())
    assert result["env"]["git_commit"]
    engines = {e["engine"]: e for e in result["entries"]}
    assert {"s01_naive_batching", "s02_kv_cache", "s04_online_scheduler", "hf_generate"} <= set(engines)
    for e in engines.values():
        assert e["throughput_tok_s"]["completion"] > 0
        assert set(e["ttft_ms"]) >= {"p50", "p99"}
    # Correctness before timing: every engine produced stage 01's greedy tokens.
    assert all(e.get("tokens_match_stage1", True) for e in engines.values())
    assert (tmp_path / "ladder.cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
