"""`stagewise worker-probe` (common/bench/worker_probe.py): the stage's own bench, with stopwatches on
its worker. Its sections must account for every token the run produced (each decode step's
batch, plus one token per prompt from its prefill) and the bench must run as it does unprobed:
the wrappers keep the signatures the bench reads. No timing is asserted.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common import cli
from common.bench import worker_probe

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
        assert run["decode_ms_max"] >= run["decode_ms_p90"]
        assert len(run["slowest"]) == min(5, run["decode_steps"])
    assert data["tpot_ms"]["p50"] > 0  # the bench's own timestamps still recorded (its knobs reached the manager)
    assert data["command"].startswith(f"stagewise worker-probe --stage {stage}") and data["env"]["git_commit"]


def test_one_engine_only(tiny) -> None:
    with pytest.raises(ValueError, match="--compare"):
        worker_probe.main(["--stage", "9", *BENCH, "--compare"])


def test_summary_of_known_sections() -> None:
    """Events with durations set by hand: every field is a sum or an order statistic the code
    could get wrong (a share taken of the wrong wall, the tail counted from the wrong median)."""
    ms = 1e-3
    events = [  # (section, start s, seconds, rows, eager); a step sits inside its decode, as in the worker
        ("prefill", 0.000, 4 * ms, 3, None),
        ("step", 0.010, 1 * ms, 3, None), ("decode", 0.010, 2 * ms, 0, None),
        ("step", 0.020, 1 * ms, 3, None), ("decode", 0.020, 2 * ms, 0, None),
        ("step", 0.030, 9 * ms, 2, None), ("decode", 0.030, 10 * ms, 0, None),  # a slow step: 10 > 2 x median 2
    ]
    run = worker_probe.summarize_run(events)
    assert run["worker_wall_s"] == pytest.approx(0.040)
    assert run["decode_steps"] == 3 and run["step_tokens"] == 8 and run["batch_mean"] == pytest.approx(8 / 3)
    assert run["decode_ms"] == pytest.approx(2) and run["step_ms"] == pytest.approx(1)
    assert run["push_ms_mean"] == pytest.approx(1)  # (14 - 11) ms of decode outside step, over 3 steps
    assert run["share"]["decode"] == pytest.approx(14 / 40) and run["share"]["prefill"] == pytest.approx(4 / 40)
    assert run["share"]["rest"] == pytest.approx(22 / 40)
    assert run["decode_ms_mean"] == pytest.approx(14 / 3) and run["decode_ms_max"] == pytest.approx(10)
    assert run["slow_decode_steps"] == 1 and run["slow_decode_share"] == pytest.approx(10 / 14)
    assert [(s["step"], s["batch"]) for s in run["slowest"]] == [(2, 2), (0, 3), (1, 3)]
    assert run["slowest"][0]["ms"] == pytest.approx(9)


def test_steps_with_and_without_the_graphs_are_told_apart() -> None:
    """Stage 12 on, each step's event says whether it ran eagerly (the engine's count moved): the
    probe gives each kind's count and median, and marks the slowest steps."""
    ms = 1e-3
    steps = [("step", 0.0, 1 * ms, 4, False), ("step", 0.1, 2 * ms, 4, False), ("step", 0.2, 30 * ms, 4, True),
             ("step", 0.3, 3 * ms, 4, False), ("step", 0.4, 50 * ms, 2, True)]
    split = worker_probe.eager_split(steps)
    assert (split["graph_steps"], split["eager_steps"]) == (3, 2)
    assert split["graph_step_ms"] == pytest.approx(2) and split["eager_step_ms"] == pytest.approx(40)
    assert split["eager_step_s_total"] == pytest.approx(0.08)
    assert [s["eager"] for s in worker_probe.decode_tail(steps, steps)["slowest"][:2]] == [True, True]
    assert worker_probe.eager_split([e[:4] + (None,) for e in steps]) == {}  # an engine without the count


def test_stage_12_counts_each_kind_of_step(tmp_path: Path, capsys, tiny) -> None:
    out = tmp_path / "probe.json"
    assert cli.main(["worker-probe", "--stage", "12", *BENCH, "--no-enforce-eager", "--json", str(out)]) == 0
    assert "steps through the graphs:" in capsys.readouterr().out
    runs = json.loads(out.read_text())["worker"]["runs"]
    assert runs
    for run in runs:
        assert run["eager_steps"] >= 1 and run["graph_steps"] >= 1  # prompts come as chunks; then decode-only
        assert run["eager_steps"] + run["graph_steps"] == run["decode_steps"]
        assert all(isinstance(s["eager"], bool) for s in run["slowest"])


@pytest.mark.parametrize("mode,eager,captured", [("off", False, False), ("graphs", False, True), ("on", True, True)])
def test_cudnn_attention_switch(tmp_path: Path, tiny, monkeypatch, mode: str, eager: bool, captured: bool) -> None:
    """Each mode reaches torch's flag in every attention call of the run (the worker thread's
    too): in the eager steps (prompt chunks) and in the graphs' padded decode function (which a
    CPU runs eagerly) each as the mode says; it is undone after the run, and the result says
    which mode ran."""
    import torch.nn.functional as F

    from common.model import DecoderModel

    seen: set[tuple[bool, bool]] = set()  # (a captured forward?, cuDNN allowed?)
    inside: list[bool] = [False]
    forward, sdpa = DecoderModel.forward, F.scaled_dot_product_attention

    def spy_forward(self, *args, captured: bool = False, **kwargs):
        inside[0] = captured
        return forward(self, *args, captured=captured, **kwargs)

    monkeypatch.setattr(DecoderModel, "forward", spy_forward)
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: (seen.add((inside[0], torch.backends.cuda.cudnn_sdp_enabled())), sdpa(*a, **k))[1])
    out = tmp_path / "probe.json"
    args = ["--stage", "12", *BENCH, "--no-enforce-eager", "--json", str(out)]
    assert worker_probe.main(args + (["--cudnn-attention"] if mode == "on" else ["--cudnn-attention", mode])) == 0
    assert seen == {(False, eager), (True, captured)}
    assert (DecoderModel.cudnn_attention, DecoderModel.cudnn_attention_captured) == (False, True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert json.loads(out.read_text())["worker"]["cudnn_attention"] == mode


@pytest.mark.parametrize("size", [[], ["--tensor-parallel-size", "2"]])  # stage 14's own default is 3
def test_cudnn_attention_is_refused_for_tensor_parallel_ranks(size: list[str]) -> None:
    """The ranks are processes of their own: the switch would reach rank 0 alone."""
    for mode in (["--cudnn-attention"], ["--cudnn-attention", "off"]):  # on, off: both change the engines' own
        with pytest.raises(ValueError, match="--cudnn-attention"):
            worker_probe.main(["--stage", "14", *BENCH, *size, *mode])
