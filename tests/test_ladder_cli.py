"""`stagewise ladder` reaches common/bench/ladder.py through the console script's dispatcher.

The ladder itself is exercised in tests/test_ladder.py; this only checks the wiring a user types.
"""
from __future__ import annotations

import pytest

from common.cli import main as stagewise


def test_stagewise_ladder_help_lists_the_workloads(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        stagewise(["ladder", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--workload", "--mode", "--out", "--stages", "--prefill-max-batch-size"):
        assert flag in out, flag
    for name in ("random-lengths", "mixed-output", "burst", "repeated-prompts"):
        assert name in out, name
