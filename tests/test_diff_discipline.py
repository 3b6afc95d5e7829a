"""Rule 1 of the house: a stage is the previous stage plus one optimization.

Every stage lists in `CHANGES` the files that differ from the previous stage; every other
file must be byte-identical to the previous stage's. That is what keeps `diff -ru` of two
adjacent stages down to one idea.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import STAGE_DIRS, stage_module

ROOT = Path(__file__).resolve().parent.parent / "stages"
PAIRS = list(zip(STAGE_DIRS, STAGE_DIRS[1:]))


def _files(stage: str) -> dict[str, bytes]:
    base = ROOT / stage
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc"}
    }


def test_stages_are_numbered_without_gaps():
    numbers = [int(name[1:3]) for name in STAGE_DIRS]
    assert numbers == list(range(1, len(numbers) + 1)), STAGE_DIRS


@pytest.mark.parametrize("prev,cur", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_undeclared_files_are_identical(prev: str, cur: str):
    declared = set(stage_module(cur).CHANGES)
    old, new = _files(prev), _files(cur)
    undeclared = sorted(f for f in set(old) | set(new) if f not in declared and old.get(f) != new.get(f))
    assert not undeclared, f"{cur} changes {undeclared} without declaring them in CHANGES"
    unchanged = sorted(f for f in declared if old.get(f) == new.get(f))
    assert not unchanged, f"{cur} declares {unchanged} in CHANGES but they are identical to {prev}'s"


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_stage_imports_common_never_another_stage(stage: str):
    """Engine code imports `common` only. Tests are exempt: a test may import its own stage, and
    stage 09's test imports stage 08 to show the contrast it measures."""
    for path in (ROOT / stage).rglob("*.py"):
        if path.name.startswith("test_"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert not node.module.startswith("stages"), f"{path} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("stages"), f"{path} imports {alias.name}"


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_stage_docstring_opens_with_what_it_adds(stage: str):
    doc = stage_module(stage).__doc__ or ""
    first = doc.strip().splitlines()[0]
    assert first.startswith(f"Stage {stage[1:3]} — "), first
