"""The built site, opened in headless chromium: every checked page loads with no uncaught JS error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="/usr/bin/chromium is absent (expected in CI): install Debian's chromium to run make docs-check")
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (the dev extra; a GPU machine's image has none)")
def test_docs_check(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
