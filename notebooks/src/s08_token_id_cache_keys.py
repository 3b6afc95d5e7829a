# %% [markdown]
# # Stage 08 — token-id cache keys
# Until now the prefix cache was keyed by the prompt *string*, so requests sent as token ids were
# never cached. `engine.prefix_cache_key(session)` now uses the token ids when the request has them.

# %% include _setup.py

# %% [markdown]
# ## The key of a text request and of a token-id request

# %%
s07 = importlib.import_module("stages.s07_admission_knob")
s08 = importlib.import_module("stages.s08_token_id_cache_keys")
engine = s08.InferenceEngine(loaded, max_batch_size=4)
old = s07.InferenceEngine(loaded, max_batch_size=4)
from common.tokenizer import encode

token_ids = encode(engine.tokenizer, PROMPTS[0])
text_req = Request(prompt=PROMPTS[0], params=SamplingParams(max_new_tokens=4))
ids_req = Request(prompt_token_ids=token_ids, params=SamplingParams(max_new_tokens=4))
for label, req in (("text", text_req), ("token ids", ids_req)):
    for name, eng in (("s07", old), ("s08", engine)):
        session = eng.new_session(req, prepare_prompt(req, eng.tokenizer, eng.max_model_len))
        print(f"{name} key of the {label} request: {eng.prefix_cache_key(session)!r}")

# %% [markdown]
# ## A repeated token-id request now hits

# %%
for name, eng in (("s07", old), ("s08", engine)):
    eng.generate([ids_req])
    eng.generate([ids_req])
    print(f"{name}: hits {eng.prefix_cache.hits}, misses {eng.prefix_cache.misses}")

# %% [markdown]
# ## In-batch dedup by token ids
# Post 004's case: four requests whose *texts* differ (a request number appended, say) but whose
# token ids are the same. They arrive in one burst (`add_requests`). Count the rows of the
# batched prefill forward. Stage 07 keys by text, so it prefills four rows. Stage 08 keys by the
# id tuple, so it prefills one row and the other three share its blocks.

# %%
for name, mod in (("s07", s07), ("s08", s08)):
    eng = mod.InferenceEngine(loaded, max_batch_size=4)
    rows = []
    forward = eng._prefill_forward
    eng._prefill_forward = lambda sessions, _f=forward: rows.append(len(sessions)) or _f(sessions)
    sched = mod.OnlineScheduler(eng, max_batch_size=4)
    burst = [mod.OnlineRequest(prompt=f"{PROMPTS[0]} #{i}", prompt_token_ids=token_ids,
                               params=SamplingParams(max_new_tokens=4)) for i in range(4)]
    rids = sched.add_requests(burst)
    tables = {tuple(sched.session(r).block_table) for r in rids}
    print(f"{name}: prefill rows {rows}, distinct block tables {len(tables)}, "
          f"cache keys {[type(k).__name__ for k in eng.prefix_cache._entries]}")

# %% [markdown]
# ## Against stage 07
# A rough illustration, see the benchmark for real numbers: one long token-id prompt, eight times.

# %%
long_ids = encode(engine.tokenizer, PROMPTS[0] * 8)
same = [Request(prompt_token_ids=long_ids, params=SamplingParams(max_new_tokens=4)) for _ in range(8)]
for name, mod in (("s07", s07), ("s08", s08)):
    eng = mod.InferenceEngine(loaded, max_batch_size=8)
    t0 = time.perf_counter()
    eng.generate(same)
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
