# %% [markdown]
# # Stage 01 — naive batching
# The baseline: requests are cut into static batches, each batch is **left-padded into one
# rectangle**, and for every new token the model runs over *all* tokens so far (no KV cache).
# This notebook runs the stage and looks at the rectangle and its attention mask.

# %% include _setup.py

# %% [markdown]
# ## Run the stage
# `InferenceEngine.generate` takes a list of `Request`s and returns one `Completion` each, in order.

# %%
s01 = importlib.import_module("stages.s01_naive_batching")
engine = s01.InferenceEngine(loaded, max_batch_size=4)
for c in engine.generate(requests()):
    print(c.finish_reason, c.token_ids, repr(c.text))

# %% [markdown]
# ## The left-padded rectangle and its mask
# Prompts of different lengths are padded on the *left*, so every row's last token sits in the
# last column. `causal_padding_mask` lets query `t` attend key `s` when `s <= t` and `s` is a
# real token (a padding query attends only itself, so no softmax row is empty).

# %%
from stages.s01_naive_batching.attention import causal_padding_mask
from stages.s01_naive_batching.engine import left_pad

seqs = [prepare_prompt(r, engine.tokenizer, engine.max_model_len).token_ids for r in requests()]
ids, valid = left_pad(seqs, engine.pad_token_id, engine.device)
print("ids", tuple(ids.shape)); print(ids)
print("valid (False = padding)"); print(valid.int())
mask = causal_padding_mask(valid)
shortest = min(range(len(seqs)), key=lambda b: len(seqs[b]))
print("mask", tuple(mask.shape), "— row", shortest, "(the shortest prompt):")
print(mask[shortest, 0].int())

# %% [markdown]
# ## What no KV cache costs
# A rough illustration, see the benchmark for real numbers. Stage 01 has no previous stage, so
# compare it with itself: each new token costs more than the last, because every
# step re-runs the whole, growing sequence. [Stage 02](../stages/02-kv-cache.md) removes that.

# %%
for n in (4, 8, 16):
    t0 = time.perf_counter()
    engine.generate(requests(n))
    print(f"{n:2d} new tokens: {time.perf_counter() - t0:.3f} s")
