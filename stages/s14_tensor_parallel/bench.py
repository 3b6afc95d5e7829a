"""Benchmark this stage: `python -m stages.<stage>.bench --help` (the harness is common/bench/harness.py)."""

from common.bench.harness import run_stage_bench

if __name__ == "__main__":
    run_stage_bench(__package__)
