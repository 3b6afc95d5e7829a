"""The stage notebooks: generated files up to date, and each one executes on the `tiny` model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("s[0-9]*_*.ipynb"))


def test_generated_notebooks_are_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "notebooks" / "build.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n(run: python notebooks/build.py)"


def test_there_is_a_notebook_per_stage():
    stages = sorted(p.name for p in (ROOT / "stages").glob("s[0-9]*_*") if p.is_dir())
    assert [p.stem for p in NOTEBOOKS] == stages


@pytest.fixture(scope="module")
def python3_kernel():
    """A `python3` kernelspec; installed into this environment (sys.prefix) when there is none."""
    from jupyter_client.kernelspec import find_kernel_specs

    if "python3" not in find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)
    return "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, python3_kernel, monkeypatch):
    import nbclient
    import nbformat

    # The kernel inherits this: one intra-op thread, since the tiny model gains nothing from more
    # and on a busy shared CPU idle OpenMP threads spin and slow every op down.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    nb = nbformat.read(path, as_version=4)
    # The kernel starts in the repo root; the notebook's first cell also walks up to it for sys.path.
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name=python3_kernel,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
