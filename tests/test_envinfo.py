"""The dirty flag in every result JSON: set by code changes, not by results being rewritten.

Why: a batch of benchmark runs rewrites committed files under docs/results/ as it goes; the
runs after the first must still say they measured the clean commit.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from common import envinfo


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
