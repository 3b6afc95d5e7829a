# %% [markdown]
# # Stage 07 — the admission knob
# `SchedulerManager(..., prefill_max_batch_size=...)` decides how many pending requests one worker
# iteration admits (one `add_requests` call, one batched prefill), apart from the decode batch size.

# %% include _setup.py

# %% [markdown]
# ## How many requests one admission takes
# Wrap `manager.scheduler.add_requests` to record the size of each call. To make the burst
# arrive all at once, park the worker just before its next admission, send six requests, then
# let it go. Decode runs 2 at a time (`max_batch_size=2`). With the knob unset, admission is
# tied to that 2. With the knob at 6, the whole burst goes into one call, one batched prefill.

# %%
import threading

s07 = importlib.import_module("stages.s07_admission_knob")
burst = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]

def park_worker(manager):
    """Hold the worker before its next admission; set the returned event to let it go."""
    go, parked = threading.Event(), threading.Event()
    admit = manager._admit_pending
    def gated():
        parked.set()
        go.wait(10)
        admit()
    manager._admit_pending = gated
    parked.wait(10)
    return go

for knob in (None, 6):
    engine = s07.InferenceEngine(loaded, max_batch_size=2)
    with s07.SchedulerManager(engine, max_batch_size=2, prefill_max_batch_size=knob) as manager:
        sizes = []
        original = manager.scheduler.add_requests
        manager.scheduler.add_requests = lambda reqs: sizes.append(len(reqs)) or original(reqs)
        go = park_worker(manager)
        handles = [manager.add_request(p, max_new_tokens=4) for p in burst]
        go.set()
        for h in handles:
            h.result()
    print(f"prefill_max_batch_size={knob}: add_requests call sizes {sizes}")

# %% [markdown]
# ## Against stage 06
# A rough illustration, see the benchmark for real numbers: the same burst through stage 06's
# manager (admission tied to the decode batch size, here 2) and stage 07's with the knob at 6.

# %%
s06 = importlib.import_module("stages.s06_prefill_microbatching")
for name, mod, extra in (("s06", s06, {}), ("s07", s07, {"prefill_max_batch_size": 6})):
    eng = mod.InferenceEngine(loaded, max_batch_size=2)
    with mod.SchedulerManager(eng, max_batch_size=2, **extra) as manager:
        t0 = time.perf_counter()
        handles = [manager.add_request(p, max_new_tokens=4) for p in burst]
        for h in handles:
            h.result()
        print(f"{name}: {time.perf_counter() - t0:.3f} s")
