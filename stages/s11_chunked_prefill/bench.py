"""Benchmark this stage: `python -m stages.<stage>.bench --help` (the harness is common/bench.py)."""

from common.bench import run_stage_bench

if __name__ == "__main__":
    run_stage_bench(__package__)
