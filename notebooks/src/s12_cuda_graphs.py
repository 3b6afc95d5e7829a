# %% [markdown]
# # Stage 12 — CUDA graphs
# On a GPU an eager decode step is the host launching a few hundred small kernels, one after the
# other, while the GPU mostly waits. This stage **captures** the decode step once per bucket of
# batch size and block-table width, and **replays** it with one launch. A step's inputs are
# copied into the graph's static buffers, padded up to the bucket; padded rows write into a
# scratch block nobody owns. On a CPU nothing is captured, and an engine runs eagerly unless
# asked: this notebook asks (`enforce_eager=False`), so the same padded path runs eagerly here
# (on a GPU, `device="cuda"` below captures for real).

# %% include _setup.py

# %% [markdown]
# ## The buckets
# Batch sizes 1, 2, 4, 8, then every 16 (nano-vllm's list); widths of the block table in powers
# of two up to the context window. A step of B sequences whose longest holds n blocks runs in the
# smallest bucket that holds both.

# %%
import random

s12 = importlib.import_module("stages.s12_cuda_graphs")
from stages.s12_cuda_graphs.cuda_graphs import batch_buckets, bucket, width_buckets

print("batch buckets up to 64:", batch_buckets(64))
print("widths for 128 blocks: ", width_buckets(128))
print("a step of 5 sequences, the longest in 3 blocks, runs in", (bucket(5, batch_buckets(64)), bucket(3, width_buckets(128))))

# %% [markdown]
# ## One engine, every decode step through a bucket
# The engine builds its `DecodeGraphs` at start (on a GPU it captures them there). On a CPU an
# engine runs eagerly unless asked: there are no launches to save, and the padding would be all
# cost. `enforce_eager=False` asks, so the padded path runs here too. Wrap `run` to see, for
# every decode-only step, the real batch and the bucket it ran in. Steps that carry a prompt
# chunk do not come here: they run eagerly, as in stage 11.

# %%
BS = 4

def token_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]

engine = s12.InferenceEngine(loaded, max_batch_size=8, block_size=BS, enforce_eager=False)
print("buckets:", engine.graphs.batch_sizes, "x widths:", engine.graphs.widths)
seen = []
run = engine.graphs.run
def spy(ids, rows, new_pos, new_slots, num_blocks):
    seen.append((len(ids), bucket(len(ids), engine.graphs.batch_sizes), bucket(num_blocks, engine.graphs.widths)))
    return run(ids, rows, new_pos, new_slots, num_blocks)
engine.graphs.run = spy

prompts = [token_ids(3 + i, seed=i) for i in range(5)]
params = [SamplingParams(max_new_tokens=4 + 3 * i, stop_on_eos=False) for i in range(5)]
out = engine.generate([Request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params)])
print("(real batch, batch bucket, width bucket) per decode step:")
print(seen)

# %% [markdown]
# ## The same tokens as the eager path
# `enforce_eager=True` (vLLM's name) runs stage 11's eager step. Padding changes no token: each
# padded row only reads and writes the scratch block, and a row's attention never looks at
# another row.

# %%
eager = s12.InferenceEngine(loaded, max_batch_size=8, block_size=BS, enforce_eager=True)
again = eager.generate([Request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params)])
print("identical tokens:", [a.token_ids for a in out] == [b.token_ids for b in again])
print("scratch block:", engine.pool.pad_block, "of", engine.pool.allocator.num_blocks, "allocatable")
print(engine.kv_stats()["cudagraphs"], "graphs captured here (0 on a CPU)")
