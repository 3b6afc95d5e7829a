"""The hand-over of the CPU's OpenMP threads to a SchedulerManager's worker (common/threads.py),
and the idle scheduling class `stagewise serve` puts that worker in.

What a CPU test can show without timing anything: the release really ends the calling thread's
OpenMP helper threads (they are OS threads, visible in /proc/self/task), and every streaming
stage calls it on the thread that builds the manager, the one whose team must go, not on the
worker; the idle class reaches the worker and the OpenMP team it starts, and nothing else. The
speed both buy is a benchmark's business (docs: Metrics, Serving).
"""
from __future__ import annotations

import os
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
from common.bench.floor import threads
from common.threads import release_caller_openmp_threads, run_at_idle_priority, set_intra_op_threads

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


IDLE = getattr(os, "SCHED_IDLE", None)


def _os_allows_idle() -> bool:
    """Can this process move a thread to SCHED_IDLE (a sandbox may refuse the system call)?

    Asked of the OS, not of run_at_idle_priority (the code under test: if it broke and returned
    False, the tests below must fail, not skip): a scratch thread moves itself (pid 0 = the
    calling thread on Linux) and ends, so nothing else changes class."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, IDLE, os.sched_param(0))
            allowed.append(os.sched_getscheduler(0) == IDLE)
        except OSError:
            allowed.append(False)

    t = threading.Thread(target=probe, name="sched-idle-probe")
    t.start()
    t.join()
    return allowed == [True]


CAN_IDLE = IDLE is not None and sys.platform.startswith("linux") and _os_allows_idle()


@pytest.mark.skipif(not CAN_IDLE, reason="Linux's SCHED_IDLE (allowed here), /proc/self/task")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch without OpenMP")
def test_idle_priority_reaches_the_openmp_team_the_thread_starts_later():
    # A fresh interpreter, so no OpenMP team exists yet but the one this script makes.
    script = textwrap.dedent("""
        import os, threading, torch
        from common.threads import release_caller_openmp_threads, run_at_idle_priority
        torch.set_num_threads(3)
        go, done = threading.Event(), threading.Event()
        def work():
            go.wait()
            torch.randn(4_000_000).add_(1.0)  # a parallel region: the thread's team of 2 helpers starts here
            done.set()
            go.clear(); go.wait(5.0)  # keep the team alive while the main thread looks
        def idle_threads():
            return sorted(tid for tid in map(int, os.listdir("/proc/self/task"))
                          if os.sched_getscheduler(tid) == os.SCHED_IDLE)
        release_caller_openmp_threads()
        t = threading.Thread(target=work)
        t.start()
        moved = run_at_idle_priority(t)
        go.set(); done.wait(60)
        idle = idle_threads()
        main_normal = os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        go.set(); t.join()
        # Too late: a thread moved after its first parallel region goes alone, its team stays normal.
        done.clear()
        late = threading.Thread(target=work)
        late.start()
        go.set(); done.wait(60)
        run_at_idle_priority(late)
        idle_late = [tid for tid in idle_threads() if tid not in idle]  # the first team may still be exiting
        go.set(); late.join()
        print(moved, len(idle), t.native_id in idle, main_normal, idle_late == [late.native_id])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    moved, idle, worker_idle, main_normal, only_late = out.stdout.split()
    assert moved == "True"
    assert int(idle) == 3, out.stdout  # the thread and the two helpers it made after the move
    assert worker_idle == "True" and main_normal == "True", out.stdout
    assert only_late == "True", out.stdout


@pytest.mark.skipif(not CAN_IDLE, reason="Linux's SCHED_IDLE (allowed here)")
def test_idle_priority_moves_that_thread_only():
    release = threading.Event()
    t = threading.Thread(target=release.wait)
    t.start()
    try:
        assert run_at_idle_priority(t) is True
        assert os.sched_getscheduler(t.native_id) == IDLE
        assert os.sched_getscheduler(0) == getattr(os, "SCHED_OTHER", 0)  # the caller keeps its class
    finally:
        release.set()
        t.join()


def test_idle_priority_is_a_no_op_without_sched_idle(monkeypatch):
    monkeypatch.delattr(os, "SCHED_IDLE", raising=False)
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    assert run_at_idle_priority(t) is False


def _serve_manager(*flags: str):
    import argparse

    from common.serve import engine as serve_engine
    p = argparse.ArgumentParser()
    serve_engine.add_serve_args(p)
    return serve_engine.build_manager(p.parse_args(["--stage", "9", "--model", "tiny", "--device", "cpu", *flags]))[0]


@pytest.mark.skipif(not CAN_IDLE, reason="Linux's SCHED_IDLE (allowed here)")
@pytest.mark.parametrize("flags, policy", [((), IDLE), (("--worker-priority", "idle"), IDLE),
                                           (("--worker-priority", "normal"), getattr(os, "SCHED_OTHER", 0))])
def test_serve_puts_its_cpu_worker_in_the_idle_class_unless_told_not_to(flags, policy):
    manager = _serve_manager(*flags)
    try:
        assert os.sched_getscheduler(manager._worker.native_id) == policy
        handle = manager.add_request(prompt="Hello", params=SamplingParams(max_new_tokens=3))
        assert handle.result(timeout=60).token_ids  # and it still runs the model
    finally:
        manager.close()
    assert os.sched_getscheduler(0) == getattr(os, "SCHED_OTHER", 0)  # the caller's own class is untouched


def test_worker_priority_auto_is_idle_on_a_cpu_only():
    from common.serve.engine import worker_priority
    assert worker_priority("auto", torch.device("cuda")) == "normal"
    assert worker_priority("normal", torch.device("cpu")) == "normal"
    assert worker_priority("auto", torch.device("cpu")) == ("idle" if IDLE is not None else "normal")
    with pytest.raises(ValueError, match="worker_priority"):
        worker_priority("low", torch.device("cpu"))


def test_thread_count_is_set_only_where_it_changes(monkeypatch):
    # torch.set_num_threads, even to the count already set, slows fp32 SDPA for the rest of the
    # process (common/threads.py): the benches' floor samples and the ladder must not call it then.
    calls: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    now = torch.get_num_threads()
    set_intra_op_threads(now)
    with threads(now):
        pass
    assert calls == []
    with threads(now + 1):
        assert torch.get_num_threads() == now + 1
    assert calls == [now + 1, now] and torch.get_num_threads() == now
