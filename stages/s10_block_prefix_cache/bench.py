"""Benchmark this stage: `python -m stages.<stage>.bench --help` (the harness is common/bench/harness.py)."""

from common.bench.harness import bench_main

if __name__ == "__main__":
    bench_main(__package__)
