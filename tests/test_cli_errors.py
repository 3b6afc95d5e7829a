"""Bad input on the command line: one line naming the field and status 2, as argparse's own errors.

Why: the tools validate much past argparse (a stage number, a model name, an engine knob), and
that validation raises ValueError naming the field. Reaching the terminal as a traceback, the
name was at the bottom of forty lines; now it is the only line.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from common import cli
from common import stages as registry
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


@pytest.mark.parametrize("package", sorted(registry.STAGES.values()))
def test_every_stage_main_takes_the_model_flags_of_every_command(package) -> None:
    """Each stage's own `python -m` has --model, --device and --dtype (common.commands.add_model_args),
    and hands --dtype to the loader: an unknown one is refused naming the field, before any weights."""
    main = importlib.import_module(f"{package}.__main__").main
    with pytest.raises(ValueError, match="^dtype: 'float8' is not supported"):
        main(["Hi", "--model", "tiny", "--device", "cpu", "--dtype", "float8"])


@pytest.mark.parametrize("package", sorted(registry.STAGES.values()))
def test_a_sampling_knob_without_do_sample_is_refused_before_any_weights(package, monkeypatch) -> None:
    """Without --do-sample the output is greedy: a typed --temperature 0.8 was unused without a
    word. Refused naming it, in every stage's main and in `stagewise generate`, before loading."""
    module = importlib.import_module(f"{package}.__main__")
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    main = module.main
    with pytest.raises(ValueError, match="^temperature: only used when sampling; add --do-sample"):
        main(["Hi", "--model", "tiny", "--temperature", "0.8"])
    with pytest.raises(ValueError, match="^top_p: only used when sampling"):
        main(["Hi", "--model", "tiny", "--temperature", "0", "--top-p", "0.9"])  # 0: greedy's spelling, allowed


def test_sampling_knobs_take_what_was_typed() -> None:
    from common.commands import add_sampling_args, sampling_knobs

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    knobs = lambda *argv: sampling_knobs(parser.parse_args(list(argv)))  # noqa: E731
    assert knobs() == {"do_sample": False} and knobs("--temperature", "0") == {"do_sample": False, "temperature": 0.0}
    assert knobs("--top-k", "0", "--top-p", "1") == {"do_sample": False, "top_k": 0, "top_p": 1.0}  # "off" asks nothing
    assert knobs("--do-sample", "--top-k", "5", "--seed", "3") == {"do_sample": True, "top_k": 5, "seed": 3}
    with pytest.raises(ValueError, match="^seed: only used when sampling"):
        knobs("--seed", "3")
    assert cli.main(["generate", "Hi", "--model", "tiny", "--top-k", "5"]) == 2


@pytest.mark.parametrize("flags, message", [(["--request-rate", "0"], "--request-rate must be > 0"),
                                            (["--request-rate", "-1"], "--request-rate must be > 0"),
                                            (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
                                            (["--chat-prompts", "--prompt-len-min", "8"],
                                             "--chat-prompts: cannot go with --prompt-len-min"),
                                            (["--chat-prompts", "--shared-prefix-len", "8"],
                                             "--chat-prompts: cannot go with --shared-prefix-len"),
                                            (["--prompt", "Hi there", "--prompt-len-min", "8"],
                                             "--prompt: cannot go with --prompt-len-min"),
                                            (["--prompt", "Hello", "--chat-prompts"],  # the default's text, typed
                                             "--prompt: cannot go with --chat-prompts"),
                                            (["--arrivals", "poisson"], "--arrivals poisson: spaces requests"),
                                            (["--long-max-new-tokens", "9"], "--long-max-new-tokens: only used")])
def test_bench_serve_refuses_a_rate_or_concurrency_that_means_nothing(flags, message) -> None:
    with pytest.raises(ValueError, match=message):  # before it sends anything (no server here)
        bench_serve.main(["--base-url", "http://127.0.0.1:9", "--model", "tiny", *flags])


def test_profile_prefill_refuses_a_prompt_longer_than_the_window(monkeypatch) -> None:
    """It was cut to the window without a word, and the report's GFLOP/s counted the whole prompt.
    Refused before the weights load."""
    from common import loader
    monkeypatch.setattr(loader, "load_model", lambda *args, **kwargs: pytest.fail("the model loaded first"))
    with pytest.raises(ValueError, match="--prompt-len 100000 is longer than the model's context window"):
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
    with pytest.raises(ValueError, match=f"^{flag} must be >= 1, got 0"):
        parse_args(["--model", "tiny", "--out", "/tmp/unused", flag, "0"])
    assert parse_args(["--model", "tiny", "--out", "/tmp/unused"]).max_batch_size >= 1  # not given: the default


def test_profile_decode_refuses_a_prompt_that_leaves_no_room_for_its_steps(monkeypatch) -> None:
    """It used to run, and report 'saw 0 decode steps'. The check needs the stage and the config
    only, so it comes before the weights load (the default model takes seconds to)."""
    from common import loader
    from common.bench import profile_decode

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(ValueError, match=r"--prompt-len 125 leaves no room .* \(128 tokens\) .* at most --prompt-len 120$"):
        profile_decode.main(["--stage", "4", "--model", "tiny", "--device", "cpu", "--prompt-len", "125", "--steps", "2"])
    with pytest.raises(ValueError, match=r"--prompt-len 115 leaves no room .* for the 17 decode steps"):  # chunked: more tokens
        profile_decode.main(["--stage", "11", "--model", "tiny", "--device", "cpu", "--batch", "16", "--prompt-len", "115", "--steps", "2"])
    with pytest.raises(ValueError, match=r"--batch 300: this stage's steps hold at most 256 tokens"):  # not 'no room'
        profile_decode.main(["--stage", "11", "--model", "tiny", "--device", "cpu", "--batch", "300", "--prompt-len", "16"])
    for flags, message in ((["--tensor-parallel-size", "2"], "--tensor-parallel-size: stages.s09_batched_worker_lookups takes"),
                           (["--no-enforce-eager"], "--no-enforce-eager: stages.s09_batched_worker_lookups takes no")):
        with pytest.raises(ValueError, match=f"^{message}"):  # the profile would be stage 09's own steps
            profile_decode.main(["--stage", "9", "--model", "tiny", "--device", "cpu", *flags])
    for flags in (["--tensor-parallel-size", "1"], ["--enforce-eager"]):  # what stage 09 does anyway: on to the load
        with pytest.raises(AssertionError, match="loaded"):
            profile_decode.main(["--stage", "9", "--model", "tiny", "--device", "cpu", "--prompt-len", "16", *flags])


@pytest.mark.parametrize("flag", ["--json", "--out"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, flag) -> None:
    """A typo in a folder used to fail after the whole run, its results lost."""
    from common.bench.flags import output_dir, output_file
    check = output_file if flag == "--json" else output_dir
    a_file = tmp_path / "a.txt"
    a_file.write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write"):  # under a file: even root cannot
        check(str(a_file / "sub" / "r.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="a directory"):
        check(str(tmp_path / "a.txt") if flag == "--out" else str(tmp_path))
    assert check(str(tmp_path / "new" / "deeper" / "r.json")) and not (tmp_path / "new").exists()  # nothing made yet
    if flag == "--json":
        assert check(os.devnull) == os.devnull  # an existing file is opened, its folder not written
        a_file.chmod(0o444)
        if os.geteuid() != 0:  # root writes a read-only file anyway
            with pytest.raises(argparse.ArgumentTypeError, match="cannot write"):
                check(str(a_file))
    command = (["parity", "--json", str(a_file / "r.json")] if flag == "--json"
               else ["ladder", "--out", str(a_file / "out"), "--model", "tiny"])
    proc = subprocess.run([sys.executable, "-m", "common.cli", *command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"argument {flag}: cannot write" in proc.stderr


def test_serve_refuses_a_host_that_does_not_resolve_before_it_loads_the_model(monkeypatch) -> None:
    """It was a socket.gaierror, after the model had loaded. The resolver is stubbed: no DNS in a test."""
    import socket

    from common.serve import engine as serve_engine

    def resolve(host, port):
        if host == "a..b":
            raise UnicodeError("encoding with 'idna' codec failed")
        if host != "127.0.0.1":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    monkeypatch.setattr(serve_engine.socket, "getaddrinfo", resolve)
    assert serve_engine.host_address("127.0.0.1") == "127.0.0.1"
    for bad, why in (("999.1.1.1", "Name or service not known"), ("a..b", "idna")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"cannot resolve '{bad}': .*{why}"):
            serve_engine.host_address(bad)


@pytest.mark.parametrize("flags, message", [(["--stage", "3"], "s03_paged_attention has no SchedulerManager"),
                                            (["--num-requests", "0"], "--num-requests must be >= 1"),
                                            (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
                                            (["--request-rate", "0"], "--request-rate must be > 0"),
                                            (["--timeout-s", "inf"], "--timeout-s must be > 0 and finite"),
                                            (["--vllm-python", "/x/python"], "--vllm-python: only used with --against vllm"),
                                            (["--vllm-kv-cache-gb", "8"], "--vllm-kv-cache-gb: only used with")])
def test_serve_compare_checks_its_flags_before_it_starts_a_server(flags, message, monkeypatch) -> None:
    """A bad stage or count used to surface only when its side's turn came, minutes in."""
    from common.serve import compare

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started")
    monkeypatch.setattr(compare, "start", no_server)
    with pytest.raises(ValueError, match=message):
        compare.main(["--model", "tiny", *flags])
    compare.check_args(compare.build_parser().parse_args(["--request-rate", "inf"]))  # a burst, as bench-serve's


@pytest.mark.parametrize("argv, line", [
    (["bench", "--stage", "13", "--model", "tiny", "--num-requests", "0"], "stagewise bench: error: --num-requests: must be >= 1"),
    (["profile-decode", "--stage", "4", "--model", "tiny", "--batch", "0"], "stagewise profile-decode: error: --batch,"),
    (["parity", "--model", "tiny", "--max-new-tokens", "0"], "stagewise parity: error: --max-new-tokens"),
    (["stability", "--stage", "4", "--processes", "0"], "stagewise stability: error: --processes: must be >= 1"),
    (["ladder", "--model", "tiny", "--out", "/tmp/unused", "--repeat-runs", "0"], "stagewise ladder: error: --repeat-runs"),
    (["bench-serve", "--base-url", "ftp://x", "--model", "tiny"], "stagewise bench-serve: error: --base-url"),
])
def test_a_bad_flag_past_argparse_reads_as_argparse_does(argv, line, capsys) -> None:
    """These checks raised SystemExit(text): status 1 and no program name, unlike every other bad flag."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_a_quiet_window_without_a_queue_delay_is_refused_by_the_bench_and_serve(monkeypatch) -> None:
    """It used to be taken and do nothing: the quiet window only ends the wait --max-queue-delay-ms starts."""
    import argparse

    from common.bench import flags, knobs
    from common.serve import engine as serve_engine, overhead as serve_overhead, server as serve_server

    message = "^--queue-quiet-ms: only with --max-queue-delay-ms > 0"
    bench = flags.build_parser("bench")
    with pytest.raises(ValueError, match=message):
        flags.check_args(bench.parse_args(["--queue-quiet-ms", "20"]))
    waits = bench.parse_args(["--queue-quiet-ms", "20", "--max-queue-delay-ms", "100"])
    flags.check_args(waits)
    assert knobs.manager_knobs(waits)["queue_quiet_ms"] == 20.0
    assert knobs.manager_knobs(bench.parse_args([]))["queue_quiet_ms"] == knobs.QUEUE_QUIET_MS  # not given
    server = argparse.ArgumentParser()
    serve_engine.add_serve_args(server)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("common.loader.load_model", no_model)
    monkeypatch.setattr(serve_overhead, "run_paired", no_model)
    with pytest.raises(ValueError, match=message):
        serve_engine.build_manager(server.parse_args(["--model", "tiny", "--queue-quiet-ms", "20"]))
    monkeypatch.setattr("common.serve.engine_process.EngineProcess", no_model)
    with pytest.raises(ValueError, match=message):  # before the engine's process starts, not in it
        serve_server.start_engine(server.parse_args(["--model", "tiny", "--engine-process", "--queue-quiet-ms", "20"]))
    # The default, which every command rebuilt from a committed result spells, is no error.
    flags.check_args(bench.parse_args(["--queue-quiet-ms", "5", "--max-queue-delay-ms", "0"]))
    with pytest.raises(ValueError, match="^--queue-quiet-ms: only with a queue delay"):  # at a rate: no wait
        serve_overhead.main(["--model", "tiny", "--request-rate", "50", "--queue-quiet-ms", "20"])


@pytest.mark.parametrize("flags, message", [
    (["--submit-interval-ms", "-50"], "--submit-interval-ms: must be a finite number >= 0"),
    (["--submit-interval-ms", "nan"], "--submit-interval-ms: must be a finite number >= 0"),
    (["--request-timeout-s", "0"], "--request-timeout-s: must be a finite number > 0"),
    (["--request-timeout-s", "nan"], "--request-timeout-s: must be a finite number > 0"),
    (["--prompt-len-min", "0"], "--prompt-len-min: must be >= 1"),
    (["--prompt-len-min", "4", "--prompt-len-max", "-1"], "--prompt-len-max: must be >= 1"),
])
def test_the_bench_refuses_a_time_or_length_that_means_nothing(flags, message) -> None:
    """A negative interval went out as a burst with a made-up submit lag, NaN wrote invalid JSON,
    a 0 s timeout failed after the weights loaded, and --prompt-len-min 0 fell back to 'Hello'."""
    from common import stages as registry
    from common.bench.flags import check_args, parse_bench_args

    args = parse_bench_args(registry.load_stage(9), flags)
    with pytest.raises(ValueError, match=f"^{message}"):
        check_args(args)


@pytest.mark.parametrize("stages, message", [("1,x", "--stages: unknown stage 'x'"), ("99", "--stages: no stage 99"),
                                             (",", "--stages: give stage numbers")])
def test_parity_checks_its_stages_before_the_reference_runs(stages, message, monkeypatch) -> None:
    from common.bench import parity

    monkeypatch.setattr(parity, "measure", lambda a, stages: pytest.fail("the reference ran before --stages was checked"))
    with pytest.raises(ValueError, match=f"^{message}"):
        parity.main(["--model", "tiny", "--stages", stages])
