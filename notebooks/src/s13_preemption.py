# %% [markdown]
# # Stage 13 — preemption
# Up to stage 12 admission booked a request's **worst case** of KV blocks, prompt plus
# `max_new_tokens`. Now it books only the **prompt**, a decode step takes a block when a
# sequence's last one fills, and when the pool runs dry the most recently admitted request is
# **preempted**: its blocks go back, its tokens stay, and later it is prefilled again over prompt
# plus generated tokens (recompute). Its output is token for token what it would have been.

# %% include _setup.py

# %% [markdown]
# ## Eight requests, a pool for three of them at their worst
# Blocks of 4 tokens, 24 of them. Each request's prompt is short and it asks for 30 to 51 tokens,
# so at its worst it needs 9 to 15 blocks: stage 12 would run two or three at a time. Stage 13
# admits all eight, and preempts when they have grown.

# %%
import random

s12 = importlib.import_module("stages.s12_cuda_graphs")
s13 = importlib.import_module("stages.s13_preemption")
BS = 4

def token_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]

prompts = [token_ids(3 + 2 * i, seed=i) for i in range(8)]
params = [SamplingParams(max_new_tokens=30 + 3 * i, stop_on_eos=False) for i in range(8)]
reqs = lambda: [Request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params)]

before = s12.InferenceEngine(loaded, max_batch_size=8, block_size=BS, num_kv_blocks=48)
after = s13.InferenceEngine(loaded, max_batch_size=8, block_size=BS, num_kv_blocks=24)
a = before.generate(reqs())
b = after.generate(reqs())
print("same tokens as stage 12 (with twice the pool):", [x.token_ids for x in a] == [y.token_ids for y in b])
stats = after.kv_stats()
print("preemptions:", stats["num_preemptions"], " recomputed tokens:", stats["recomputed_tokens"])
print(f"KV pool in use: mean {stats['kv_usage_mean']:.0%}, peak {stats['kv_usage_peak']:.0%}")
print(f"requests in a step: mean {stats['running_mean']:.1f}, peak {stats['running_peak']}")

# %% [markdown]
# ## Watch one preemption
# Step a scheduler by hand and print, after every step, which requests are running, which wait
# preempted, and how many blocks are free. A preempted request comes back at the head of the
# queue and prefills its prompt and its tokens so far in chunks, then decodes on.

# %%
engine = s13.InferenceEngine(loaded, max_batch_size=4, block_size=BS, num_kv_blocks=12)
sched = s13.OnlineScheduler(engine, max_batch_size=4)
rids = [sched.add_request(prompt_token_ids=token_ids(4, seed=40 + i),
                          params=SamplingParams(max_new_tokens=14, stop_on_eos=False)) for i in range(3)]
step = 0
while sched.has_unfinished() and step < 40:
    sched.step()
    step += 1
    state = {r: ("done" if sched.session(r).finished else "preempted" if sched.session(r).preempted
                 else "prefill" if sched.session(r).prefilling else "decode") for r in rids if r in sched}
    print(f"step {step:2d}  free blocks {engine.pool.allocator.num_available:2d}  {state}")
print("preemptions:", engine.num_preemptions)
