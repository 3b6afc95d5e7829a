# %% [markdown]
# # Stage 03 — paged attention
# The KV cache becomes a **pool of fixed-size blocks**. Each request's `InferenceSession` owns
# a `block_table` (its block numbers, in order) and takes a new block only when the last fills.

# %% [markdown]
# ## Load a model
# `tiny` is a small random-weight model that loads in a second, so the outputs are gibberish
# but every code path runs. For real text, change `"tiny"` to `"smollm2-135m"` (the default
# model; slower on a CPU).

# %%
# Put the repository root on sys.path: walk up from the working directory until common/ and stages/ appear.
import importlib, sys, time
from pathlib import Path

root = Path.cwd().resolve()
while not ((root / "common").is_dir() and (root / "stages").is_dir()):
    if root.parent == root:
        raise RuntimeError("start this notebook from inside the stagewise repository")
    root = root.parent
sys.path.insert(0, str(root))

from common.loader import load_model
from common.requests import Request, SamplingParams, prepare_prompt

loaded = load_model("tiny", device="cpu")  # swap "tiny" for "smollm2-135m" to use the real model
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
def requests(n_tokens=8, prompts=PROMPTS):
    return [Request(prompt=p, params=SamplingParams(max_new_tokens=n_tokens)) for p in prompts]

# %% [markdown]
# ## Run the stage

# %%
s03 = importlib.import_module("stages.s03_paged_attention")
engine = s03.InferenceEngine(loaded, max_batch_size=4, block_size=4)
for c in engine.generate(requests()):
    print(c.finish_reason, c.token_ids, repr(c.text))
print(engine.kv_stats())

# %% [markdown]
# ## A session's block table
# Book the worst case (`reserve`), prefill the prompt (blocks are taken as tokens arrive), then
# give everything back. Watch the allocator's free count. Blocks of 4 tokens here, to see
# several; the default is 16.

# %%
alloc = engine.pool.allocator
req = Request(prompt="The quick brown fox jumps over the lazy dog", params=SamplingParams(max_new_tokens=8))
session = engine.new_session(req, prepare_prompt(req, engine.tokenizer, engine.max_model_len))
print("free blocks before:", alloc.num_free, "of", alloc.num_blocks)
engine.reserve(session)
engine.prefill(session)
print(f"prompt of {len(session.prompt_ids)} tokens -> block_table {session.block_table}")
print("free blocks after prefill:", alloc.num_free, " still booked for decode:", session.reserved)
session.release_kv_blocks()
print("free blocks after release:", alloc.num_free)

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
