"""`stagewise serve-compare`: stagewise serve and `transformers serve`, each in a fresh process, one client.

End to end on the tiny model (both servers really start, on 127.0.0.1, and really answer), and the
pieces that decide fairness: both servers get the same weights, device and dtype, and one side's
runs from several server starts are summarized together. Nothing is timed.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from common import stages as registry
from common.serve import compare as serve_compare
from common.loader import model_dir, resolve_device
from conftest import TEST_DEVICE

HAS_TRANSFORMERS_SERVE = importlib.util.find_spec("transformers.cli.serve") is not None


def test_both_servers_get_the_same_weights_device_and_dtype() -> None:
    a = serve_compare.build_parser().parse_args(["--model", "tiny", "--num-requests", "12"])
    cmds = serve_compare.server_commands(a, Path("/m"), "cpu", "float32", 8123)
    ours, theirs = cmds["stagewise"], cmds["transformers"]
    for cmd in (ours, theirs):
        assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--dtype") + 1] == "float32"
        assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--continuous-batching" in theirs and "/m" in theirs  # the library's scheduler, on our directory
    assert ours[ours.index("--max-batch-size") + 1] == "12"  # the whole burst in one batch, as theirs
    assert "--no-prefix-cache" in ours  # a repeated burst must not be answered from the cache
    a = serve_compare.build_parser().parse_args(["--max-batch-size", "4"])
    assert "4" in serve_compare.server_commands(a, Path("/m"), "cpu", "float32", 1)["stagewise"]


def test_against_vllm_both_get_the_same_weights_dtype_batch_and_no_prefix_cache() -> None:
    """vLLM's CPU server from a Python of its own: our directory under our model's name, the same
    dtype, as many sequences as stagewise's batch, no prefix cache; its threads on every core."""
    a = serve_compare.build_parser().parse_args(["--against", "vllm", "--vllm-python", "/opt/v/bin/python",
                                                 "--num-requests", "12", "--vllm-threads-bind", "0-1"])
    cmds = serve_compare.server_commands(a, Path("/m"), "cpu", "bfloat16", 8123)
    theirs = cmds["vllm"]
    assert theirs[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert theirs[theirs.index("--model") + 1] == "/m" and theirs[theirs.index("--served-model-name") + 1] == a.model
    assert theirs[theirs.index("--dtype") + 1] == "bfloat16" == cmds["stagewise"][cmds["stagewise"].index("--dtype") + 1]
    assert theirs[theirs.index("--max-num-seqs") + 1] == "12" and "--no-enable-prefix-caching" in theirs
    assert theirs[theirs.index("--port") + 1] == "8123"
    assert serve_compare.server_env(a, "vllm")["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert serve_compare.server_env(a, "stagewise") == {}
    with pytest.raises(ValueError, match="--vllm-python"):
        serve_compare.main(["--against", "vllm"])
    with pytest.raises(ValueError, match="ignore_eos"):
        serve_compare.main(["--no-stop-on-eos"])


def test_one_side_is_summarized_over_every_server_start() -> None:
    def run(tok_s: float) -> dict:
        return {"requests": 2, "prompt_tokens": 4, "completion_tokens": 8, "wall_s": 8 / tok_s,
                "throughput_tok_s": {"completion": tok_s, "total": tok_s * 1.5},
                "ttft_ms": {"p50": 10.0, "p95": 10.0, "p99": 10.0}, "tpot_ms": {"p50": 1.0, "p95": 1.0, "p99": 1.0}}

    starts = [{"runs": [run(10.0), run(30.0)], "server": {"data": []}, "config": {"x": 1}}, {"runs": [run(20.0)]}]
    side = serve_compare.combine("A", ["python", "-m", "x"], starts)
    assert side["throughput_tok_s"]["completion"] == 20.0  # the median of all three runs
    assert side["spread"]["throughput_completion_tok_s"] == {"min": 10.0, "max": 30.0}
    assert len(side["runs"]) == 3 and side["engine"] == "A" and side["server_command"] == "python -m x"


@pytest.mark.skipif(not HAS_TRANSFORMERS_SERVE, reason="this transformers has no `transformers serve`")
def test_serve_compare_runs_both_servers_end_to_end(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STAGEWISE_API_KEY", "a key of the user's")  # not for the server it starts: its client sends none
    out = tmp_path / "compare.json"
    assert serve_compare.main(["--model", "tiny", "--device", TEST_DEVICE, "--dtype", "float32", "--num-requests", "4",
                               "--max-new-tokens", "8", "--warmup-runs", "0", "--repeat-runs", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    theirs = result["compare"][0]
    assert result["kind"] == "serve-compare" and result["dtype"] == "float32"
    assert result["device"] == resolve_device(TEST_DEVICE).type
    assert result["engine"].startswith("stagewise serve s") and theirs["engine"] == "transformers serve (CB)"
    for side in (result, theirs):
        assert side["requests"] == 4 and side["completion_tokens"] > 0 and len(side["runs"]) == 1
    assert str(model_dir("tiny")) in theirs["server_command"] and sys.executable in result["server_command"]
    assert result["server"]["data"][0]["owned_by"] == "stagewise"
    assert result["command"].endswith(f"--stage {max(registry.STAGES)}")  # the newest of today, named for a rerun
    # it was transformers that answered (its /v1/models fails offline in some releases: then no list)
    assert theirs["server"] is None or theirs["server"]["data"][0]["id"] == str(model_dir("tiny"))
    # Both greedy, on the same weights in fp32, the same 4 prompts: two correct engines do the same work.
    assert result["same_completion_tokens"] is True
    assert result["ratios"]["throughput_completion"] > 0
    assert "completion tokens per run" in capsys.readouterr().out
