# %% [markdown]
# # Stage 02 — KV cache
# Each step now feeds only the newest token: the keys and values of earlier tokens are kept in a
# **contiguous KV cache**, one rectangle per layer sized for the batch's worst case.

# %% include _setup.py

# %% [markdown]
# ## Run the stage

# %%
s02 = importlib.import_module("stages.s02_kv_cache")
engine = s02.InferenceEngine(loaded, max_batch_size=4)
for c in engine.generate(requests()):
    print(c.finish_reason, c.token_ids, repr(c.text))
print(engine.kv_stats())

# %% [markdown]
# ## The cache's tensors
# Per layer one K and one V tensor of shape `[B, Hkv, capacity, D]` (heads first, as SDPA reads
# them). Every row reserves `capacity` = longest prompt + `max_new_tokens`, used or not: that
# waste is what stage 03's paged blocks remove.

# %%
from stages.s02_kv_cache.kv_cache import ContiguousKVCache

seqs = [prepare_prompt(r, engine.tokenizer, engine.max_model_len).token_ids for r in requests()]
capacity = max(len(s) for s in seqs) + 8
cache = ContiguousKVCache(loaded.config, len(seqs), capacity, loaded.dtype, loaded.device)
print("layers:", len(cache.k), "  K[0]:", tuple(cache.k[0].shape), cache.k[0].dtype)
print("reserved:", cache.nbytes, "bytes")
used = sum(len(s) + 8 for s in seqs)
print(f"token slots used: {used} of {len(seqs) * capacity} ({used / (len(seqs) * capacity):.0%})")

# %% [markdown]
# ## Against stage 01
# A rough illustration, see the benchmark for real numbers (one run each, tiny model).

# %%
s01 = importlib.import_module("stages.s01_naive_batching")
for name, mod in (("s01", s01), ("s02", s02)):
    eng = mod.InferenceEngine(loaded, max_batch_size=4)
    t0 = time.perf_counter()
    eng.generate(requests(16))
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
