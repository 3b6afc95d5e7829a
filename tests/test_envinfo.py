"""The dirty flag in every result JSON: set by code changes, not by results being rewritten.

Why: a batch of benchmark runs rewrites committed files under docs/results/ as it goes; the
runs after the first must still say they measured the clean commit.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from common.bench import envinfo


@pytest.fixture
def repo(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "engine.py").write_text("x = 1\n")
    (tmp_path / "docs" / "results" / "r.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "init")
    monkeypatch.setattr(envinfo, "REPO_ROOT", tmp_path)
    for name in ("STAGEWISE_GIT_COMMIT", "STAGEWISE_GIT_DIRTY"):  # set where the suite runs on a GPU machine
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_clean_checkout_is_clean(repo) -> None:
    info = envinfo.git_info()
    assert info["git_dirty"] is False and len(info["git_commit"]) == 40


def test_rewritten_results_and_new_files_do_not_count(repo) -> None:
    (repo / "docs" / "results" / "r.json").write_text('{"new": 1}\n')
    (repo / "untracked.txt").write_text("scratch\n")
    assert envinfo.git_info()["git_dirty"] is False


def test_a_code_change_is_dirty(repo) -> None:
    (repo / "engine.py").write_text("x = 2\n")
    assert envinfo.git_info()["git_dirty"] is True


def test_a_commit_during_the_run_is_reported(repo, monkeypatch) -> None:
    """The JSON names the code the process loaded, and says so when the checkout moved meanwhile
    (a benchmark run from a checkout that someone commits to during the run)."""
    monkeypatch.setattr(envinfo, "GIT_AT_START", envinfo.git_info())
    assert "code_changed_during_run" not in envinfo.collect_env("cpu")
    start = envinfo.GIT_AT_START["git_commit"]
    (repo / "engine.py").write_text("x = 3\n")
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "edit"],
                   check=True, capture_output=True)
    env = envinfo.collect_env("cpu")
    assert env["git_commit"] == start and env["code_changed_during_run"] is True
    assert env["git_now"]["git_commit"] != start and env["git_now"]["git_dirty"] is False


def test_a_copy_without_git_takes_its_commit_from_the_command(tmp_path, monkeypatch) -> None:
    """A GPU machine is sent the working tree, not .git: the sender names the commit."""
    monkeypatch.setattr(envinfo, "REPO_ROOT", tmp_path)  # no repository here
    monkeypatch.delenv("STAGEWISE_GIT_COMMIT", raising=False)
    monkeypatch.delenv("STAGEWISE_GIT_DIRTY", raising=False)  # set where the suite runs on a GPU machine
    assert envinfo.git_info() == {"git_commit": None, "git_dirty": None}
    monkeypatch.setenv("STAGEWISE_GIT_COMMIT", "a" * 40)
    assert envinfo.git_info() == {"git_commit": "a" * 40, "git_dirty": True}  # clean only when said so
    monkeypatch.setenv("STAGEWISE_GIT_DIRTY", "0")
    assert envinfo.git_info() == {"git_commit": "a" * 40, "git_dirty": False}


def test_the_variable_wins_over_a_stale_repository(repo, monkeypatch) -> None:
    """On the GPU machine a .git at an older commit came with the tree: the sender knows better."""
    monkeypatch.setenv("STAGEWISE_GIT_COMMIT", "b" * 40)
    monkeypatch.setenv("STAGEWISE_GIT_DIRTY", "0")
    assert envinfo.git_info() == {"git_commit": "b" * 40, "git_dirty": False}
    monkeypatch.delenv("STAGEWISE_GIT_COMMIT")
    assert envinfo.git_info()["git_commit"] not in (None, "b" * 40)  # unset: the repository's own


def test_env_names_the_cpu_kernels_and_reads_family_and_flags_from_cpuinfo(tmp_path, monkeypatch) -> None:
    """"AMD EPYC" covers several generations; bf16 rounding and speed follow the kernels (test_bf16)."""
    import torch

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                       "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    from common import linear  # where /proc/cpuinfo is read (common.linear.cpuinfo)

    real_path = linear.Path
    monkeypatch.setattr(linear, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    info = envinfo.cpuinfo()
    assert envinfo.cpu_model(info) == "AMD EPYC"
    fields = envinfo.cpu_features(info)
    assert fields == {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_family_model": "25/17",
                      "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}
    monkeypatch.setattr(linear, "Path", lambda p: tmp_path / "missing")
    assert envinfo.cpuinfo() == {}
    assert envinfo.cpu_features({}) == {"cpu_capability": torch.backends.cpu.get_cpu_capability()}


def test_env_records_the_variables_that_change_speed(monkeypatch) -> None:
    """A run with THP_MEM_ALLOC_ENABLE=1 or OMP_NUM_THREADS=1 is another experiment: its JSON must say so."""
    environ = {"OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1", "MALLOC_TRIM_THRESHOLD_": "0",
               "HOME": "/root", "PATH": "/usr/bin", "THP_OTHER": "x"}
    assert envinfo.speed_env(environ) == {"MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1",
                                          "THP_MEM_ALLOC_ENABLE": "1"}
    for name in [k for k in os.environ if k.startswith(envinfo.SPEED_ENV_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert envinfo.collect_env()["speed_env"] == {"THP_MEM_ALLOC_ENABLE": "1"}
