# %% [markdown]
# # Stage 04 — online scheduler
# Requests no longer wait for a static batch: an `OnlineScheduler` admits a request at any time
# (prefill plus its first token), and every `step()` decodes one token for the running ones. A
# `SchedulerManager` drives it from a worker thread and streams text back.

# %% include _setup.py

# %% [markdown]
# ## Step by step
# `step()` returns `{request_id: token_id}` for the sessions it decoded. A request added midway
# joins the next step.

# %%
s04 = importlib.import_module("stages.s04_online_scheduler")
engine = s04.InferenceEngine(loaded, max_batch_size=4)
sched = s04.OnlineScheduler(engine, max_batch_size=4)
a = sched.add_request(PROMPTS[0], max_new_tokens=5)
b = sched.add_request(PROMPTS[1], max_new_tokens=3)
step = 0
while sched.has_unfinished():
    step += 1
    print("step", step, sched.step())
    if step == 1:
        c = sched.add_request(PROMPTS[2], max_new_tokens=3)
    for rid in sched.pop_finished_ids():
        done = sched.pop_completion(rid)
        print("   finished", rid, done.finish_reason, done.token_ids)

# %% [markdown]
# ## A stream through the SchedulerManager
# `add_request` returns a handle at once; iterate it for `StreamChunk(text, token_ids)`.

# %%
with s04.SchedulerManager(engine, max_batch_size=4) as manager:
    handle = manager.add_request(PROMPTS[0], max_new_tokens=6)
    for chunk in handle:
        print(repr(chunk.text), chunk.token_ids)
    print("result:", handle.result().finish_reason)

# %% [markdown]
# ## Against stage 03
# A rough illustration, see the benchmark for real numbers (one run each, tiny model). Offline
# `generate` is not where stage 04 shines; its win is latency under arriving traffic.

# %%
s03 = importlib.import_module("stages.s03_paged_attention")
for name, mod in (("s03", s03), ("s04", s04)):
    eng = mod.InferenceEngine(loaded, max_batch_size=4)
    t0 = time.perf_counter()
    eng.generate(requests(16))
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
