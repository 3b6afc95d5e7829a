# %% [markdown]
# # Stage 09 — batched worker lookups
# After each decode step the worker hands every request its token. Stage 08 took the manager's
# lock once per token; stage 09 takes it **once per step**, collects what it needs, and does the
# detokenizing and queueing outside the lock.

# %% include _setup.py

# %% [markdown]
# ## Count lock acquisitions per decode step
# Replace the manager's lock with a counting wrapper, and wrap `_run_decode_once` so that only
# acquisitions made inside a decode step are counted.

# %%
import threading

class CountingLock:
    """A threading.Lock that counts the acquisitions made while `counting` is set on this thread."""
    def __init__(self):
        self._lock, self.local, self.count = threading.Lock(), threading.local(), 0
    def acquire(self, *args, **kwargs):
        if getattr(self.local, "counting", False):
            self.count += 1
        return self._lock.acquire(*args, **kwargs)
    def release(self):
        self._lock.release()
    def locked(self):
        return self._lock.locked()
    __enter__ = acquire
    def __exit__(self, *exc):
        self.release()

def locks_per_step(mod, n_requests=4, n_tokens=8):
    engine = mod.InferenceEngine(loaded, max_batch_size=8)
    manager = mod.SchedulerManager(engine, max_batch_size=8)
    lock = manager._lock = CountingLock()  # before any request: nothing else holds the old one
    per_step = []
    original = manager._run_decode_once
    def counted_decode_once():
        before = lock.count
        lock.local.counting = True
        try:
            original()
        finally:
            lock.local.counting = False
        per_step.append(lock.count - before)
    manager._run_decode_once = counted_decode_once
    t0 = time.perf_counter()
    handles = [manager.add_request(f"{PROMPTS[i % 3]} {i}", max_new_tokens=n_tokens) for i in range(n_requests)]
    for h in handles:
        h.result()
    elapsed = time.perf_counter() - t0
    manager.close()
    return per_step, elapsed

s08 = importlib.import_module("stages.s08_token_id_cache_keys")
s09 = importlib.import_module("stages.s09_batched_worker_lookups")
results = {name: locks_per_step(mod) for name, mod in (("s08", s08), ("s09", s09))}
for name, (per_step, _) in results.items():
    print(f"{name}: lock acquisitions per decode step {per_step}")

# %% [markdown]
# ## Against stage 08
# A rough illustration, see the benchmark for real numbers: the wall time of the runs above.
# With a handful of requests on a tiny model the lock is not the bottleneck; the saving grows
# with the batch size and with callers contending for the lock.

# %%
for name, (_, elapsed) in results.items():
    print(f"{name}: {elapsed:.3f} s")
