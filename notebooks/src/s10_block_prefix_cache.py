# %% [markdown]
# # Stage 10 — block prefix cache
# The prefix cache now keys every **full KV block** by its token ids, chained with the key of
# the block before it. Two prompts that share a system prompt share its blocks, even when they
# end in different questions. Stages 01–09 follow the source posts; this stage goes past them,
# toward vLLM's design.

# %% include _setup.py

# %% [markdown]
# ## Two prompts, one system prompt
# A long shared system prompt and two different questions. Stage 09 keys whole prompts, so the
# second request misses. Blocks of 4 tokens here, so that there are many of them to look at.

# %%
s09 = importlib.import_module("stages.s09_batched_worker_lookups")
s10 = importlib.import_module("stages.s10_block_prefix_cache")
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. "
          "Today's context: the stagewise engine is built in numbered stages.")
CHAT = [SYSTEM + " Question: what is a KV block?", SYSTEM + " Question: why chain the block keys?"]
BS = 4

old = s09.InferenceEngine(loaded, max_batch_size=4, block_size=BS)
old.generate(requests(4, prompts=CHAT))
print("stage 09: hits", old.prefix_cache.hits, "misses", old.prefix_cache.misses, "(two different prompts)")

# %% [markdown]
# ## Chained block keys
# `block_keys` gives one key per *full* block: `key[i] = hash((key[i-1], tokens of block i))`.
# The keys of the two prompts agree up to the first block where their tokens differ, and from
# there on they all differ: each key stands for everything before it.

# %%
ids = [prepare_prompt(Request(prompt=p), loaded.tokenizer, loaded.config.max_position_embeddings).token_ids
       for p in CHAT]
keys = [s10.block_keys(i, BS) for i in ids]
same = next(n for n, (x, y) in enumerate(zip(*keys)) if x != y)
print("prompt lengths:", [len(i) for i in ids], " full blocks:", [len(k) for k in keys])
print(f"the first {same} keys are equal; block {same} differs:")
print("  prompt 0, block", same, loaded.tokenizer.decode(ids[0][same * BS:(same + 1) * BS]))
print("  prompt 1, block", same, loaded.tokenizer.decode(ids[1][same * BS:(same + 1) * BS]))

# %% [markdown]
# ## The same physical blocks
# Admit the first prompt, then the second. The second request's `reserve` finds the shared
# leading blocks in the cache and attaches them: its block table starts with the first
# request's block ids, and each of those blocks has two owners.

# %%
engine = s10.InferenceEngine(loaded, max_batch_size=4, block_size=BS)
sched = s10.OnlineScheduler(engine, max_batch_size=4)
a = sched.add_request(CHAT[0], max_new_tokens=4)
b = sched.add_request(CHAT[1], max_new_tokens=4)
ta, tb = sched.session(a).block_table, sched.session(b).block_table
refs = engine.pool.allocator.ref_counts
print("first's table: ", ta)
print("second's table:", tb)
print(f"shared: the first {same} blocks, ref counts {[refs[x] for x in tb[:same]]}")
stats = engine.kv_stats()
print("hits", stats["prefix_cache_hits"], "misses", stats["prefix_cache_misses"],
      "| prompt tokens from the cache:", stats["prefix_cache_hit_tokens"], "of", stats["prefix_cache_query_tokens"],
      f"(= {same} blocks x {BS})")
while sched.has_unfinished():
    sched.step()

# %% [markdown]
# ## Cached blocks nobody holds: free, but remembered
# Both requests are done. Their blocks went back to the pool, but the cached ones went to the
# allocator's **evictable** LRU, not to the plain free list. They count as free, and a new
# prompt can still take them back.

# %%
alloc = engine.pool.allocator
print("blocks in use:", alloc.num_blocks - alloc.num_free, " free:", alloc.num_free,
      " of which evictable (cached):", alloc.num_evictable, " cached blocks:", len(engine.prefix_cache))

# %% [markdown]
# ## An exact repeat still runs a small forward
# The cache holds K/V, not logits, and the first token is sampled from the last prompt token's
# logits. So `match` leaves at least that token to compute: an exact repeat reuses every full
# block except the one that holds its last token. (Stage 05 kept the last logits and ran no
# forward at all.)

# %%
before = engine.prefix_cache.hit_tokens
engine.generate(requests(4, prompts=[CHAT[0]]))
hit = engine.prefix_cache.hit_tokens - before
print(f"repeat of a {len(ids[0])}-token prompt: {hit} tokens from the cache, {len(ids[0]) - hit} computed")

# %% [markdown]
# ## A burst shares the blocks it writes
# `add_requests` prefills a burst in one forward. A prompt can reuse the blocks that an earlier
# prompt of the *same* forward writes. Wrap `_prefill_forward` to see how many tokens each prompt
# computes in that one packed row.

# %%
engine = s10.InferenceEngine(loaded, max_batch_size=4, block_size=BS)
computed = []
original = engine._prefill_forward
def counting_prefill_forward(sessions, starts, slots):
    computed.append([len(s.prompt_ids) - start for s, start in zip(sessions, starts)])
    return original(sessions, starts, slots)
engine._prefill_forward = counting_prefill_forward

sched = s10.OnlineScheduler(engine, max_batch_size=4)
burst = CHAT + [SYSTEM + " Question: what is evicted first?"]
rids = sched.add_requests([s10.OnlineRequest(prompt=p, params=SamplingParams(max_new_tokens=4)) for p in burst])
print("forwards:", len(computed), " tokens computed per prompt:", computed[0])
print("tables:")
for rid in rids:
    print(" ", sched.session(rid).block_table)
while sched.has_unfinished():
    sched.step()

# %% [markdown]
# ## Eviction under a tiny pool
# A pool of 16 blocks. Prompt A leaves its blocks cached. Prompt B, with nothing in common,
# needs more blocks than the plain free list has, so the allocator evicts cached blocks, least
# recently freed first. A session frees its blocks last block first, so A's **tail** goes and
# its head survives: A again is a partial hit.

# %%
rng = __import__("random").Random(0)
A = [rng.randrange(100, 1000) for _ in range(7 * BS)]
B = [rng.randrange(100, 1000) for _ in range(11 * BS)]
small = s10.InferenceEngine(loaded, max_batch_size=1, block_size=BS, num_kv_blocks=16)
def run(prompt_ids):
    return small.generate([Request(prompt_token_ids=prompt_ids, params=SamplingParams(max_new_tokens=2, stop_on_eos=False))])[0]
cache, alloc = small.prefix_cache, small.pool.allocator

run(A)
print("after A: cached blocks", len(cache), " evictable", alloc.num_evictable, " plain free", alloc.num_free - alloc.num_evictable)
run(B)
survived = [k in cache._block_of for k in s10.block_keys(A, BS)]
print("after B: A's blocks still cached:", survived)
before = cache.hit_tokens
run(A)
print("A again:", cache.hit_tokens - before, "tokens from the cache (its surviving head)")

# %% [markdown]
# ## The same tokens as with the cache off
# Reusing K/V must not change a single token. `enable_prefix_caching=False` (the benches'
# `--no-prefix-cache`) turns the cache off: the same greedy tokens, every prompt prefilled in full.

# %%
prompts = CHAT + [SYSTEM + " Question: what is evicted first?", CHAT[0]]
on = s10.InferenceEngine(loaded, max_batch_size=2, block_size=BS)
off = s10.InferenceEngine(loaded, max_batch_size=2, block_size=BS, enable_prefix_caching=False)
got_on = [c.token_ids for c in on.generate(requests(6, prompts=prompts))]
got_off = [c.token_ids for c in off.generate(requests(6, prompts=prompts))]
print("identical tokens:", got_on == got_off)
print("cache on:  tokens from the cache", on.kv_stats()["prefix_cache_hit_tokens"], "of", on.kv_stats()["prefix_cache_query_tokens"])
print("cache off: tokens from the cache", off.kv_stats()["prefix_cache_hit_tokens"])
