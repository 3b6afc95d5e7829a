# %% [markdown]
# # Stage 03 — paged attention
# The KV cache becomes a **pool of fixed-size blocks**. Each request's `InferenceSession` owns
# a `block_table` (its block numbers, in order) and takes a new block only when the last fills.

# %% include _setup.py

# %% [markdown]
# ## Run the stage

# %%
s03 = importlib.import_module("stages.s03_paged_attention")
engine = s03.InferenceEngine(loaded, max_batch_size=4, block_size=4)
for c in engine.generate(requests()):
    print(c.finish_reason, c.token_ids, repr(c.text))
print(engine.kv_stats())

# %% [markdown]
# ## The pool
# One K and one V tensor per layer, `[Hkv, num_blocks, block_size, D]` (heads first, so that
# copying whole blocks gives attention its `[Hkv, B, L, D]` layout directly), shared by every request.

# %%
pool = engine.pool
print("layers:", len(pool.k), "  K[0]:", tuple(pool.k[0].shape), "  bytes per block:", pool.bytes_per_block)

# %% [markdown]
# ## Block tables and the free list
# Book the worst case (`reserve`), prefill two prompts (blocks are taken from the head of the
# free list as tokens arrive), then give the first one back: its blocks go to the *end* of the
# free list, ready for the next request. Blocks of 4 tokens here, to see several; the default is 16.

# %%
alloc = engine.pool.allocator
def new_session(prompt):
    req = Request(prompt=prompt, params=SamplingParams(max_new_tokens=8))
    session = engine.new_session(req, prepare_prompt(req, engine.tokenizer, engine.max_model_len))
    engine.reserve(session)  # books its worst case: prompt + 8 new tokens
    engine.prefill(session)  # writes the prompt's K/V, taking blocks as they fill
    return session

print("free list head:", list(alloc._free)[:10], f"({alloc.num_free} free of {alloc.num_blocks})")
first = new_session("The quick brown fox jumps over the lazy dog")
second = new_session("Once upon a time")
for name, s in (("first", first), ("second", second)):
    print(f"{name}: {len(s.prompt_ids)} prompt tokens -> block_table {s.block_table}, "
          f"{s.reserved} more blocks booked for decode")
print("slots of the first prompt's tokens:", first.context_slots().tolist())
# The device mirror the decode step reads: one row per session, its blocks and its length.
for name, s in (("first", first), ("second", second)):
    print(f"{name}: row {s.row}: table {pool.tables.table[s.row, :len(s.block_table)].tolist()}, "
          f"length {int(pool.tables.lengths[s.row])}")
print("free list head:", list(alloc._free)[:6], " booked:", alloc.reserved)
first.release_kv_blocks()
print("after releasing the first: free list tail", list(alloc._free)[-4:], " booked:", alloc.reserved)
second.release_kv_blocks()
print("free blocks after both:", alloc.num_free, "of", alloc.num_blocks)

# %% [markdown]
# ## Against stage 02
# A rough illustration, see the benchmark for real numbers (one run each, tiny model).

# %%
s02 = importlib.import_module("stages.s02_kv_cache")
for name, mod in (("s02", s02), ("s03", s03)):
    eng = mod.InferenceEngine(loaded, max_batch_size=4)
    t0 = time.perf_counter()
    eng.generate(requests(16))
    print(f"{name}: {time.perf_counter() - t0:.3f} s")
