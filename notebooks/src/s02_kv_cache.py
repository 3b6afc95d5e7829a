# %% [markdown]
# # Stage 02 — KV cache
# Each step now feeds only the newest token: the keys and values of earlier tokens are kept in a
# **contiguous KV cache**, one rectangle per layer sized for the batch's worst case.

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
