"""Bad input on the command line: one line naming the field and status 2, as argparse's own errors.

Why: the tools validate much past argparse (a stage number, a model name, an engine knob), and
that validation raises ValueError naming the field. Reaching the terminal as a traceback, the
name was at the bottom of forty lines; now it is the only line.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from common import cli
from common.bench import profile_prefill
from common.serve import bench as bench_serve


def test_stagewise_bad_input_is_one_line_and_status_2(capsys) -> None:
    assert cli.main(["bench", "--model", "tiny", "--stage", "99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stagewise bench: error: stage: no stage 99") and err.count("\n") == 1


def test_a_stage_main_says_which_field_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "stages.s13_preemption", "Hi", "--model", "tiny",
                           "--max-new-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "python -m stages.s13_preemption: error: max_new_tokens must be > 0, got 0\n"


@pytest.mark.parametrize("flags, message", [(["--request-rate", "0"], "--request-rate must be > 0"),
                                            (["--request-rate", "-1"], "--request-rate must be > 0"),
                                            (["--max-concurrency", "0"], "--max-concurrency must be >= 1")])
def test_bench_serve_refuses_a_rate_or_concurrency_that_means_nothing(flags, message) -> None:
    with pytest.raises(SystemExit, match=message):  # before it sends anything (no server here)
        bench_serve.main(["--base-url", "http://127.0.0.1:9", "--model", "tiny", *flags])


def test_profile_prefill_refuses_a_prompt_longer_than_the_window() -> None:
    """It was cut to the window without a word, and the report's GFLOP/s counted the whole prompt."""
    with pytest.raises(SystemExit, match="--prompt-len 100000 is longer than the model's context window"):
        profile_prefill.main(["--stage", "4", "--model", "tiny", "--device", "cpu", "--prompt-len", "100000"])


def test_serve_refuses_a_port_out_of_range() -> None:
    import argparse

    from common.serve.engine import port_number
    assert port_number("0") == 0 and port_number("65535") == 65535
    for bad in ("-1", "65536"):
        with pytest.raises(argparse.ArgumentTypeError, match="a port is 0 to 65535"):
            port_number(bad)


def test_worker_probe_refuses_a_stage_without_a_worker() -> None:
    from common.bench.worker_probe import instrument
    with pytest.raises(ValueError, match="^stage: stages.s02_kv_cache has no SchedulerManager"):
        instrument("stages.s02_kv_cache")


@pytest.mark.parametrize("flag", ["--max-batch-size", "--prefill-max-batch-size", "--num-kv-blocks", "--threads"])
def test_the_ladder_refuses_a_size_of_0_instead_of_taking_its_default(flag) -> None:
    from common.bench.ladder_rungs import parse_args
    with pytest.raises(SystemExit, match=f"^{flag} must be >= 1, got 0"):
        parse_args(["--model", "tiny", "--out", "/tmp/unused", flag, "0"])
    assert parse_args(["--model", "tiny", "--out", "/tmp/unused"]).max_batch_size >= 1  # not given: the default
