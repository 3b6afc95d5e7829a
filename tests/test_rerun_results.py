"""scripts/rerun_results.py: every committed result maps to a command that writes it again, and
the check names each result whose commit differs or whose checkout was dirty."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
rerun = load_script("rerun_results")


def test_every_committed_result_has_a_command_that_writes_it_again() -> None:
    paths = rerun.result_files("cpu")
    assert len(paths) > 20 and all(p.parent == rerun.RESULTS / "cpu" for p in paths)  # not machines/, questions/
    for path in paths:
        argv = rerun.argv_for(path)
        assert argv[0] == sys.executable and argv[1] == "-m", path.name
        assert argv[2] == "common.cli" or (argv[2].startswith("stages.s") and argv[2].endswith(".bench")), path.name
        if "--json" in argv:
            assert argv[argv.index("--json") + 1] == f"docs/results/cpu/{path.name}"
        else:
            assert argv[2:4] == ["common.cli", "ladder"] and argv[argv.index("--out") + 1] == "docs/results/cpu"


def test_every_committed_stage_bench_command_gives_back_its_config() -> None:
    """The command a page prints under a stage bench's table is rebuilt from the result's config;
    parsed as a reader's typed flags (over the stage's BENCH, where a typed kind of prompt or pool
    size replaces the stage's own), it must give back that very config, in every folder: a flag
    rule that drops or reinterprets a spelled flag would make the page's command measure
    something else."""
    import importlib
    import shlex

    from common.bench.flags import check_args, parse_bench_args
    from stagewise_commands import placed_command

    checked = 0
    for path in sorted(rerun.RESULTS.rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not (isinstance(data.get("command"), str) or data.get("config")):
            continue
        words = shlex.split(placed_command(data, path.relative_to(ROOT).as_posix()))
        if words[:2] != ["python", "-m"] or not words[2].startswith("stages."):
            continue
        args = parse_bench_args(importlib.import_module(words[2].removesuffix(".bench")), words[3:])
        check_args(args)
        differ = {key: (want, getattr(args, key)) for key, want in (data.get("config") or {}).items()
                  if key != "json" and hasattr(args, key)
                  and want != (list(getattr(args, key)) if isinstance(want, list) else getattr(args, key))}
        assert not differ, (path.relative_to(ROOT).as_posix(), differ)
        checked += 1
    assert checked > 50  # the stage benches of cpu/, cuda/, machines/ and questions/


def test_a_scratch_json_path_is_sent_back_to_the_results(tmp_path, monkeypatch) -> None:
    """serve-overhead run with --json /tmp/x.json and copied in: the rerun writes it in place."""
    results = tmp_path / "docs" / "results"
    (results / "cpu").mkdir(parents=True)
    (results / "cpu" / "serve.cpu.json").write_text(json.dumps({"command": "stagewise serve-overhead --stage 9 --json /tmp/x.json"}))
    monkeypatch.setattr(rerun, "ROOT", tmp_path)
    monkeypatch.setattr(rerun, "RESULTS", results)
    [path] = rerun.result_files("cpu")
    assert rerun.argv_for(path)[1:] == ["-m", "common.cli", "serve-overhead", "--stage", "9",
                                         "--json", "docs/results/cpu/serve.cpu.json"]


def test_a_serve_compare_of_the_newest_stage_of_its_day_reruns_that_stage(tmp_path, monkeypatch) -> None:
    """Recorded as `serve-compare` with no --stage when stage 11 was the newest: the rerun pins 11."""
    results = tmp_path / "docs" / "results"
    (results / "cpu").mkdir(parents=True)
    (results / "cpu" / "serve-compare.cpu.json").write_text(json.dumps(
        {"command": "stagewise serve-compare --rounds 2 --json docs/results/serve-compare.cpu.json",
         "stage": "s11_chunked_prefill"}))
    monkeypatch.setattr(rerun, "ROOT", tmp_path)
    monkeypatch.setattr(rerun, "RESULTS", results)
    [path] = rerun.result_files("cpu")
    assert rerun.argv_for(path)[1:] == ["-m", "common.cli", "serve-compare", "--rounds", "2",
                                         "--json", "docs/results/cpu/serve-compare.cpu.json", "--stage", "11"]


def test_check_names_results_from_another_commit_or_a_dirty_checkout(tmp_path, capsys) -> None:
    def result(name: str, commit: str, dirty: bool = False) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"env": {"git_commit": commit, "git_dirty": dirty}}))
        return path

    same = [result("a.cpu.json", "abc"), result("b.cpu.json", "abc")]
    assert rerun.check(same, "abc") == 0
    assert rerun.check(same + [result("c.cpu.json", "def")], "abc") == 1
    assert "c.cpu.json  <-- another commit" in capsys.readouterr().out
    assert rerun.check(same + [result("d.cpu.json", "abc", dirty=True)], None) == 1
    assert "d.cpu.json  <-- dirty" in capsys.readouterr().out


def test_resume_runs_only_what_is_not_from_this_commit(tmp_path, monkeypatch, capsys) -> None:
    results = tmp_path / "docs" / "results"
    (results / "cpu").mkdir(parents=True)
    for name, commit in (("s01_x.cpu.json", "head"), ("s02_x.cpu.json", "old")):
        (results / "cpu" / name).write_text(json.dumps({"env": {"git_commit": commit, "git_dirty": False},
                                                "command": f"stagewise profile-decode --json /tmp/{name}"}))
    monkeypatch.setattr(rerun, "ROOT", tmp_path)
    monkeypatch.setattr(rerun, "RESULTS", results)
    monkeypatch.setattr("common.bench.envinfo.git_info", lambda: {"git_commit": "head", "git_dirty": False})
    assert rerun.main(["--resume", "--list"]) == 0
    out = capsys.readouterr().out
    assert "docs/results/cpu/s02_x.cpu.json" in out and "s01_x" not in out


def test_like_runs_one_devices_commands_into_anothers_files(tmp_path, monkeypatch, capsys) -> None:
    """A first CUDA set: the CPU results' commands, each writing its `.cuda.` twin (resumable)."""
    results = tmp_path / "docs" / "results"
    (results / "cpu").mkdir(parents=True)
    (results / "cuda").mkdir()
    for name in ("s01_x.cpu.json", "s02_x.cpu.json"):
        (results / "cpu" / name).write_text(json.dumps({"env": {"git_commit": "old", "git_dirty": False},
                                                        "command": f"stagewise profile-decode --json /tmp/{name}"}))
    (results / "cpu" / "ladder.cpu.json").write_text(json.dumps({"command": "stagewise ladder --out docs/results"}))
    (results / "cuda" / "s01_x.cuda.json").write_text(json.dumps({"env": {"git_commit": "head", "git_dirty": False}}))
    monkeypatch.setattr(rerun, "ROOT", tmp_path)
    monkeypatch.setattr(rerun, "RESULTS", results)
    monkeypatch.setattr("common.bench.envinfo.git_info", lambda: {"git_commit": "head", "git_dirty": False})
    assert rerun.main(["--like", "cpu", "--device", "cuda", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines] == ["docs/results/cuda", "docs/results/cuda/s01_x.cuda.json",
                                                    "docs/results/cuda/s02_x.cuda.json"]
    assert rerun.main(["--like", "cpu", "--device", "cuda", "--list", "--resume"]) == 0
    assert "s01_x" not in capsys.readouterr().out  # its CUDA file is from this commit already
    if not __import__("torch").cuda.is_available():  # names that say cuda are never written from a CPU
        with pytest.raises(SystemExit, match="runs on cpu"):
            rerun.main(["--like", "cpu", "--device", "cuda"])


def test_a_bench_results_rebuilt_command_parses_back_to_its_config() -> None:
    """The command a stage page prints (and the rerun runs) is the one that made the result: the
    bench's own parser reads it back to the very config the JSON records. (It printed
    `--fresh-engine`, a flag no bench has, until the store-False flags were mapped.)"""
    import importlib
    import shlex

    from common.bench import flags
    from stagewise_commands import command_from

    checked = 0
    for path in rerun.result_files("cpu"):
        data = json.loads(path.read_text())
        if isinstance(data.get("command"), str):
            continue
        words = shlex.split(command_from(data))
        assert words[:2] == ["python", "-m"] and words[2].endswith(".bench"), path.name
        args = flags.parse_bench_args(importlib.import_module(words[2].rsplit(".", 1)[0]), words[3:])
        assert {k: getattr(args, k, "missing") for k in data["config"]} == data["config"], path.name
        flags.check_args(args)  # and the bench takes it: a reader who copies it gets a run, not an error
        checked += 1
    assert checked >= 10


def test_a_written_command_splits_back_into_its_words(tmp_path) -> None:
    """An argument with spaces (worker-probe passes bench flags such as --prompt through) is quoted."""
    import shlex

    from common.bench.results import write_result

    words = ["--stage", "9", "--prompt", "Why is the sky blue?"]
    write_result(tmp_path / "r.json", {"device": "cpu"}, "worker-probe", words)
    command = json.loads((tmp_path / "r.json").read_text())["command"]
    assert shlex.split(command) == ["stagewise", "worker-probe", *words]
