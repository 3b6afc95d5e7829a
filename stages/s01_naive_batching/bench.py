"""Benchmark this stage: `python -m stages.<stage>.bench --help` (the harness is common/bench/harness.py)."""

from common.bench.harness import run_stage_bench
from common.cli import exit_on_bad_input

if __name__ == "__main__":
    exit_on_bad_input(lambda: run_stage_bench(__package__), f"python -m {__package__}.bench")
