"""How a result is written: JSON, with the command that made it and the machine it ran on.

Every number in the docs comes from such a file (docs/results/), so each one carries its own
provenance: `command`, and `env` (commit, versions, CPU, device: common/bench/envinfo.py).
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from common.bench.envinfo import collect_env


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)


def write_result(path: str | Path, result: dict, program: str, argv: list[str] | None) -> None:
    """A `stagewise <program>` result with the command that made it and where it ran (`result["device"]`)."""
    words = sys.argv[1:] if argv is None else argv
    command = shlex.join(["stagewise", program, *words])  # quoted: the rerun test splits it back with shlex
    write_json(path, {**result, "command": command, "env": collect_env(result["device"])})


def write_script_result(path: str | Path, result: dict, script: str, argv: list[str] | None) -> None:
    """A result of `python scripts/<script>` (the micro-benchmarks, which run on the CPU), with the
    command that made it and where it ran."""
    words = sys.argv[1:] if argv is None else argv
    write_json(path, {**result, "command": shlex.join(["python", f"scripts/{script}", *words]), "env": collect_env("cpu")})


def print_and_write(program: str, result: dict, report: str, path: str | None, argv: list[str] | None) -> int:
    """Print a `stagewise <program>` report, and write its result where `--json` said (if it did)."""
    print(report, flush=True)
    if path:
        write_result(path, result, program, argv)
    return 0
