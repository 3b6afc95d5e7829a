# %% [markdown]
# # Stage 06 — prefill micro-batching
# `OnlineScheduler.add_requests` admits a whole burst with **one batched prefill** forward, and a
# prompt that appears twice in the burst is prefilled once and its blocks shared.

# %% include _setup.py

# %% [markdown]
# ## A burst with a duplicate
# Wrap `engine._prefill_forward` to count forwards and the rows in each.

# %%
s06 = importlib.import_module("stages.s06_prefill_microbatching")
engine = s06.InferenceEngine(loaded, max_batch_size=4)
forwards = []
original = engine._prefill_forward
def counting_prefill_forward(sessions):
    forwards.append(len(sessions))
    return original(sessions)
engine._prefill_forward = counting_prefill_forward

sched = s06.OnlineScheduler(engine, max_batch_size=4)
params = SamplingParams(max_new_tokens=4)
burst = [s06.OnlineRequest(prompt=p, params=params) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[0])]
ids = sched.add_requests(burst)
print("request ids:", ids)
print("prefill forwards:", len(forwards), " rows per forward:", forwards, "(3 requests, 2 distinct prompts)")
while sched.has_unfinished():
    sched.step()
for rid in ids:
    print(rid, sched.pop_completion(rid).token_ids)

# %% [markdown]
# ## Against stage 05
# A rough illustration, see the benchmark for real numbers: a burst of six prompts admitted at
# once (stage 05 admits them one by one, one prefill each).

# %%
s05 = importlib.import_module("stages.s05_prefix_cache")
prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
for name, mod in (("s05", s05), ("s06", s06)):
    eng = mod.InferenceEngine(loaded, max_batch_size=8)
    sch = mod.OnlineScheduler(eng, max_batch_size=8)
    t0 = time.perf_counter()
    if name == "s05":
        for p in prompts:
            sch.add_request(p, max_new_tokens=4)
    else:
        sch.add_requests([mod.OnlineRequest(prompt=p, params=SamplingParams(max_new_tokens=4)) for p in prompts])
    while sch.has_unfinished():
        sch.step()
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
