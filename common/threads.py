"""Leave the CPU's OpenMP threads to the one thread that runs the model.

Why this exists: PyTorch's CPU wheels run intra-op parallelism on GNU OpenMP (libgomp). Every
thread that starts a parallel region gets its own team of helper threads, and the team lives as
long as that thread. libgomp counts the helpers of all teams; once there are more of them than
CPUs, a helper waiting for work spins only ~100 times before it sleeps on a futex (`do_spin` in
libgomp's `wait.h`), so each of the hundreds of parallel regions in a decode step pays a sleep
and a wake-up. A `SchedulerManager`'s worker is exactly such a second thread: the thread that
loaded the model already has a team. On the 2-core CPU this made a streamed decode step about
half as long again as the same step offline (stage 04's page has the before/after results).

`omp_pause_resource_all` (OpenMP 5.0) frees the calling thread's team. Called by the thread that
hands the model to a worker, it leaves libgomp counting the worker's team alone, which spins as
it should. If the caller runs parallel work again later, it gets a new team (and the worker is
slowed again until the next call): call it after the caller's last piece of model work.

`run_at_idle_priority` is the server's half of the same story (`stagewise serve`, docs: Serving):
it puts the worker, and so the OpenMP team the worker will start, below every other thread of the
machine in the kernel's scheduler.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a restart would need


def release_caller_openmp_threads() -> bool:
    """Free the calling thread's OpenMP helper threads; True if an OpenMP runtime did it.

    A no-op (False) where no OpenMP runtime is loaded into the process's global symbols, or it
    predates OpenMP 5.0; nothing breaks, the worker just keeps sharing the CPU with idle helpers.
    """
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no CDLL(None)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0


def set_intra_op_threads(n: int) -> None:
    """`torch.set_num_threads(n)`, unless the process already runs `n` threads.

    Why the check: the call is not free even when it changes nothing. Besides OpenMP's count it
    sets MKL's and turns MKL's dynamic adjustment off (ATen's ParallelOpenMP.cpp), and fp32
    SDPA's CPU kernel calls MKL's sgemm from inside its own parallel loop, where, after that
    call, MKL starts a team of its own for each sgemm (`MKL_VERBOSE=1`: `Dyn:0 ... NThr:2`,
    against `Dyn:1 ... NThr:1` before). On a 2-core Zen 5 one `torch.set_num_threads(2)` in a
    process already at 2 left that kernel twice as slow for the rest of the process (a decode
    step's fp32 SDPA, 0.49 against 0.95 ms a layer), while bf16's SDPA, the packed matmuls and
    the K/V gather stayed as they were. The benches set the threads around every floor sample,
    so every run after the first, and the profiles' timed steps, paid it. Turning MKL's dynamic
    adjustment back on afterwards does not last: PyTorch sets the count again, and the
    adjustment with it, in each thread that first runs parallel work.
    """
    if int(n) != torch.get_num_threads():
        torch.set_num_threads(int(n))


def run_at_idle_priority(thread: threading.Thread) -> bool:
    """Move a started `thread` to Linux's SCHED_IDLE class; True if that was done.

    Why: on a CPU the worker thread and its OpenMP helpers keep every core busy through a decode
    step. A server's event loop, which writes each token to its client, and a client on the same
    machine wake for tens of microseconds at a time; a woken thread of the normal class can still
    wait for the running one's time slice to end before it gets a core. A SCHED_IDLE thread is
    preempted at once by any normal thread that wakes, and otherwise runs as before: the engine
    has the CPU whenever nobody else wants it, and gives it up the moment somebody does. The
    price: anything CPU-bound elsewhere on the machine now comes first, all of the time.

    Call it before the thread's first parallel work: libgomp makes the thread's OpenMP team then,
    and a new thread starts in its creator's class, so the helpers come out SCHED_IDLE too (a
    team made earlier would keep the normal class). False, and nothing changed, where the OS has
    no SCHED_IDLE (not Linux) or refuses.
    """
    if not hasattr(os, "SCHED_IDLE") or thread.native_id is None:
        return False
    try:
        os.sched_setscheduler(thread.native_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True
