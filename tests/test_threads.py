"""The hand-over of the CPU's OpenMP threads to a SchedulerManager's worker (common/threads.py).

What a CPU test can show without timing anything: the release really ends the calling thread's
OpenMP helper threads (they are OS threads, visible in /proc/self/task), and every streaming
stage calls it on the thread that builds the manager, the one whose team must go, not on the
worker. The speed it buys is a benchmark's business (docs: Metrics).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from common import stages as registry
from conftest import streaming_packages
from common.requests import SamplingParams
from common.threads import release_caller_openmp_threads

STREAMING = streaming_packages()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch without OpenMP")
def test_release_ends_the_callers_openmp_threads():
    # A fresh interpreter: the count must not depend on what this test process ran before.
    script = textwrap.dedent("""
        import os, time, torch
        from common.threads import release_caller_openmp_threads
        tasks = lambda: len(os.listdir("/proc/self/task"))
        torch.set_num_threads(3)
        before = tasks()
        torch.randn(4_000_000).add_(1.0)  # big enough to run as a parallel region: 2 helpers join
        with_team = tasks()
        def release():  # -> (what the call returned, threads once the team is gone or 5 s passed)
            released = release_caller_openmp_threads()
            deadline = time.monotonic() + 5.0
            while tasks() > before and time.monotonic() < deadline:
                time.sleep(0.01)
            return released, tasks()
        released, after = release()
        x = torch.arange(4_000_000, dtype=torch.float64).mul_(2.0)  # the thread still computes, in parallel
        correct = bool(x[-1] == 2.0 * (4_000_000 - 1)) and bool(x.sum() == 4_000_000 * (4_000_000 - 1))
        again = tasks()
        released2, after2 = release()  # the new team goes the same way
        print(before, with_team, released, after, correct, again, released2, after2)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    before, with_team, released, after, correct, again, released2, after2 = out.stdout.split()
    assert int(with_team) == int(before) + 2, out.stdout  # the parallel region started a team
    assert released == "True"
    assert int(after) == int(before), out.stdout  # and the release ended it
    # Not a one-way switch: the same thread computes again, right, with a new team, released again.
    assert correct == "True", out.stdout
    assert int(again) == int(before) + 2, out.stdout
    assert released2 == "True" and int(after2) == int(before), out.stdout


def test_release_is_a_no_op_where_the_runtime_lacks_it(monkeypatch):
    """No `omp_pause_resource_all` in the process (no OpenMP, or not libgomp 5.0): False, nothing raised."""
    import ctypes

    class NoOpenMP:
        def __init__(self, name):
            pass

        def __getattr__(self, symbol):
            raise AttributeError(symbol)

    monkeypatch.setattr(ctypes, "CDLL", NoOpenMP)
    assert release_caller_openmp_threads() is False


@pytest.mark.parametrize("package", STREAMING)
def test_manager_releases_the_callers_threads_before_its_worker_starts(package, tiny, monkeypatch):
    stage = registry.load_stage(package)
    server = sys.modules[stage.SchedulerManager.__module__]
    calls: list[tuple[str, bool]] = []

    def record() -> bool:
        workers = [t for t in threading.enumerate() if t.name == "stagewise-worker"]
        calls.append((threading.current_thread().name, len(workers) > len(before)))
        return True

    before = [t for t in threading.enumerate() if t.name == "stagewise-worker"]
    monkeypatch.setattr(server, "release_caller_openmp_threads", record)
    manager = stage.SchedulerManager(stage.InferenceEngine(tiny, max_batch_size=2), max_batch_size=2)
    try:
        assert calls == [(threading.current_thread().name, False)], calls
        handle = manager.add_request(prompt="Hello", params=SamplingParams(max_new_tokens=3))
        assert handle.result(timeout=60).token_ids  # the worker still runs the model
    finally:
        manager.close()
