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
"""

from __future__ import annotations

import ctypes

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
