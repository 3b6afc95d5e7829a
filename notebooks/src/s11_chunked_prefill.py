# %% [markdown]
# # Stage 11 — chunked prefill
# Each scheduler step is now **one forward under a token budget**, `max_num_batched_tokens`. It
# holds one token for every decoding session first, then chunks of waiting prompts with what is
# left. A long prompt takes several steps, and the running streams get a token in every one of
# them. Stages 01–09 follow the source posts; this stage goes past them, toward what vLLM and
# SGLang do.

# %% include _setup.py

# %% [markdown]
# ## Watch every step
# Wrap the engine's `_step_forward` to record, for every step, how many decode rows it ran and
# which prompt chunks it computed: (first position, tokens). The stage's tests spy on steps the
# same way.

# %%
import random

s10 = importlib.import_module("stages.s10_block_prefix_cache")
s11 = importlib.import_module("stages.s11_chunked_prefill")
BS = 4  # small blocks, so that a short prompt spans many of them

def token_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]

def record_steps(engine):
    steps = []
    original = engine._step_forward
    def spy(decode, chunks, slots):
        steps.append({"decode": len(decode), "chunks": [(start, s.num_cached - start) for s, start in chunks]})
        return original(decode, chunks, slots)
    engine._step_forward = spy
    return steps

# %% [markdown]
# ## Three streams and a 41-token prompt, budget 8
# Three short requests are decoding. Then a 41-token prompt arrives. With a budget of 8 tokens,
# every step pays 3 tokens for the streams first, and the prompt gets the other 5. That makes
# 8 chunks of 5 and a last chunk of 1. The prompt's first token is sampled in the step that
# computes its last token. (The prefix cache is off here, so that no block is reused.)

# %%
engine = s11.InferenceEngine(loaded, max_batch_size=4, block_size=BS, max_num_batched_tokens=8,
                             enable_prefix_caching=False)
sched = s11.OnlineScheduler(engine, max_batch_size=4)
stream_params = SamplingParams(max_new_tokens=30, stop_on_eos=False)
STREAM_PROMPTS = [token_ids(3, seed=i) for i in range(3)]
streams = [sched.add_request(prompt_token_ids=p, params=stream_params) for p in STREAM_PROMPTS]
while any(sched.session(r).prefilling for r in streams):
    sched.step()  # the streams' own short prompts: one step

steps = record_steps(engine)
LONG = token_ids(41, seed=99)
long_params = SamplingParams(max_new_tokens=4, stop_on_eos=False)
rid = sched.add_request(prompt_token_ids=LONG, params=long_params)
print("step  decode rows  chunk (start, tokens)  tokens in the forward  streams got a token  first token of the long prompt")
i = 0
while sched.session(rid).prefilling:
    got = sched.step()
    st = steps[i]
    total = st["decode"] + sum(n for _, n in st["chunks"])
    print(f"{i + 1:>4}  {st['decode']:>11}  {str(st['chunks'][0]):>21}  {total:>21}  "
          f"{str(all(r in got for r in streams)):>19}  {got.get(rid, '-')}")
    i += 1

# %% [markdown]
# ## Stage 10: one forward for the whole prompt
# The same three streams and the same prompt on stage 10. `add_request` prefills the whole
# prompt at once, in a forward of 41 tokens. No stream gets a token during that forward. On a
# real model, with a 2,000-token prompt, that forward is the stall this stage removes.

# %%
old = s10.InferenceEngine(loaded, max_batch_size=4, block_size=BS, enable_prefix_caching=False)
old_sched = s10.OnlineScheduler(old, max_batch_size=4)
old_streams = [old_sched.add_request(prompt_token_ids=p, params=stream_params) for p in STREAM_PROMPTS]
prefills = []
original_prefill = old._prefill_forward
def counting_prefill(sessions, starts, slots):
    prefills.append([len(s.prompt_ids) - start for s, start in zip(sessions, starts)])
    return original_prefill(sessions, starts, slots)
old._prefill_forward = counting_prefill
old_sched.step()
old_rid = old_sched.add_request(prompt_token_ids=LONG, params=long_params)  # prefilled right here
print("stage 10: prefill forwards for the long prompt:", len(prefills), " tokens:", prefills[0])
print("          its first token already exists:", old_sched.session(old_rid).generated)

# %% [markdown]
# ## The same tokens
# Chunking changes when K/V are computed, not what they are: each chunk attends to the blocks
# that earlier chunks wrote. Greedy tokens equal stage 10's and those of stage 11 with a budget
# so large that every prompt fits in one step.

# %%
while sched.has_unfinished():
    sched.step()
while old_sched.has_unfinished():
    old_sched.step()
chunked = [sched.pop_completion(r).token_ids for r in streams + [rid]]
unchunked_10 = [old_sched.pop_completion(r).token_ids for r in old_streams + [old_rid]]
print("long prompt, stage 11 (budget 8):", chunked[-1])
print("long prompt, stage 10:           ", unchunked_10[-1])
print("all four requests identical:", chunked == unchunked_10)

prompts = [token_ids(n, seed=n) for n in (5, 23, 40, 9, 31)]
def run(budget):
    eng = s11.InferenceEngine(loaded, max_batch_size=3, block_size=BS, max_num_batched_tokens=budget)
    reqs = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=6, stop_on_eos=False)) for p in prompts]
    return [c.token_ids for c in eng.generate(reqs)]
print("budget 7 vs budget 4096, five prompts of 5-40 tokens: identical:", run(7) == run(4096))

# %% [markdown]
# ## A chunk starts at the first uncached block
# The prefix cache of stage 10 still works, chunk by chunk. A second prompt with the same 20
# leading tokens (5 blocks) finds them cached, so its first chunk starts at position 20.

# %%
engine = s11.InferenceEngine(loaded, max_batch_size=2, block_size=BS, max_num_batched_tokens=6)
system = token_ids(5 * BS, seed=5)
params = SamplingParams(max_new_tokens=3, stop_on_eos=False)
engine.generate([Request(prompt_token_ids=system + token_ids(3, seed=6), params=params)])
steps = record_steps(engine)
engine.generate([Request(prompt_token_ids=system + token_ids(9, seed=7), params=params)])
print("chunks of the second prompt (start, tokens):", [c for st in steps for c in st["chunks"]])
print("prompt tokens from the cache:", engine.prefix_cache.hit_tokens)

# %% [markdown]
# ## The budget must hold a full decode batch
# Decode rows come first and are never cut, so a budget below `max_batch_size` could not run a
# full decode step. The engine refuses it, as vLLM does.

# %%
try:
    s11.InferenceEngine(loaded, max_batch_size=8, max_num_batched_tokens=4)
except ValueError as e:
    print("ValueError:", e)
