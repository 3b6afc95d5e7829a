"""`stagewise worker-probe` (common/worker_probe.py): the stage's own bench, with stopwatches on
its worker. Its sections must account for every token the run produced (each decode step's
batch, plus one token per prompt from its prefill) and the bench must run as it does unprobed:
the wrappers keep the signatures the bench reads. No timing is asserted.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common import cli, worker_probe

BENCH = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--num-requests", "6", "--max-new-tokens", "5",
         "--no-stop-on-eos", "--max-batch-size", "4", "--warmup-runs", "1", "--repeat-runs", "2"]


@pytest.mark.parametrize("stage", ["4", "9"])  # add_request (one prefill a prompt) and add_requests (batched)
def test_sections_account_for_every_token(stage: str, tmp_path: Path, capsys, tiny) -> None:
    out = tmp_path / "probe.json"
    assert cli.main(["worker-probe", "--stage", stage, *BENCH, "--submit-interval-ms", "2", "--json", str(out)]) == 0
    assert "Worker, medians of 2 measured runs" in capsys.readouterr().out
    data = json.loads(out.read_text())
    w = data["worker"]
    assert len(w["runs"]) == 2 == len(data["runs"])  # the warm-up's manager is left out
    for run, bench_run in zip(w["runs"], data["runs"]):
        prompts = run["prefills"] * run["prompts_per_prefill"]
        assert prompts == 6 and run["step_tokens"] + prompts == bench_run["completion_tokens"]
        assert run["batch_mean"] <= 4 and run["step_ms"] <= run["decode_ms"]
        assert sum(run["share"].values()) == pytest.approx(1.0)
    assert data["tpot_ms"]["p50"] > 0  # the bench's own timestamps still recorded (its knobs reached the manager)
    assert data["command"].startswith(f"stagewise worker-probe --stage {stage}") and data["env"]["git_commit"]


def test_one_engine_only(tiny) -> None:
    with pytest.raises(ValueError, match="--compare"):
        worker_probe.main(["--stage", "9", *BENCH, "--compare"])
