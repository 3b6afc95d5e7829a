# %% [markdown]
# # Stage 05 — prefix cache
# A finished prompt's KV blocks (and last logits) stay in a **prefix cache** keyed by the prompt
# string: the same prompt again skips its prefill and shares the blocks.

# %% include _setup.py

# %% [markdown]
# ## Run the stage

# %%
s05 = importlib.import_module("stages.s05_prefix_cache")
engine = s05.InferenceEngine(loaded, max_batch_size=4)
for c in engine.generate(requests()):
    print(c.finish_reason, c.token_ids, repr(c.text))

# %% [markdown]
# ## Hits and misses
# Three new prompts were three misses. Send the first prompt again: one hit, no forward pass.

# %%
cache = engine.prefix_cache
print("after the first run:", "entries", len(cache), "hits", cache.hits, "misses", cache.misses)
engine.generate(requests(prompts=[PROMPTS[0]]))
print("after a repeat:     ", "entries", len(cache), "hits", cache.hits, "misses", cache.misses)
print("keys:", list(cache._entries))

# %% [markdown]
# ## Inside an entry: shared, ref-counted blocks
# An entry holds the prompt's block table, the prompt's token ids and the last logits. The cache
# holds one reference to each block. A session that hits adds its own reference. It reads the
# blocks, and takes a private copy of the last, half-full block before it writes into it
# (copy-on-write). Blocks of 4 tokens here, to see several.

# %%
engine = s05.InferenceEngine(loaded, max_batch_size=4, block_size=4)
sched = s05.OnlineScheduler(engine, max_batch_size=4)
prompt = "The quick brown fox jumps over the lazy dog"
first = sched.add_request(prompt, max_new_tokens=4)   # a miss: prefilled, then cached
second = sched.add_request(prompt, max_new_tokens=4)  # a hit: no forward pass
entry = engine.prefix_cache._entries[prompt]
refs = engine.pool.allocator.ref_counts
print(f"entry: {len(entry.prompt_ids)} prompt tokens in blocks {entry.block_table}, "
      f"last_logits {tuple(entry.last_logits.shape)}")
print("ref counts of those blocks:", [refs[b] for b in entry.block_table], "(cache + first + second)")
print("first's table: ", sched.session(first).block_table)
print("second's table:", sched.session(second).block_table, "(the same blocks)")
sched.step()  # both write their next token: the shared last block is copied first
print("after one decode step:")
print("first's table: ", sched.session(first).block_table)
print("second's table:", sched.session(second).block_table)
print("ref counts of the cached blocks:", [refs[b] for b in entry.block_table])

# %% [markdown]
# ## Against stage 04
# A rough illustration, see the benchmark for real numbers: the same prompt eight times.

# %%
s04 = importlib.import_module("stages.s04_online_scheduler")
same = requests(4, prompts=[PROMPTS[0] * 8] * 8)
for name, mod in (("s04", s04), ("s05", s05)):
    eng = mod.InferenceEngine(loaded, max_batch_size=8)
    t0 = time.perf_counter()
    eng.generate(same)
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
