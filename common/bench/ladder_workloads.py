"""The ladder's workloads: what each one shows, its requests, and its engine knobs.

Each workload isolates one effect (padding waste, a burst, a repeated prompt, a long prompt
arriving mid-decode...), so a reader can pick the one that shows the stage they study. They are
fitted into the model's context window here, so a tiny model can run every one of them.
"""

from __future__ import annotations

import argparse

from common.requests import prepare_prompt

LONG_PROMPT = (
    "You are a careful assistant. Answer briefly and precisely. Here is the context for every question "
    "today: the stagewise engine is built in nine stages; each stage adds one idea to the previous one — a "
    "KV cache, paged attention, continuous batching, a prefix cache, batched prefill, an admission knob, "
    "token-id cache keys and batched worker lookups. Question: what does stage five add?")

# name -> (what it shows, build_workload kwargs, engine knobs). Each isolates one effect.
WORKLOADS: dict[str, tuple[str, dict, dict]] = {
    "default": ("a small mix: random prompt lengths, 1 request in 8 wants 4x the tokens",
                dict(num_requests=16, prompt_len_range=(16, 64), max_new_tokens=8, long_every=8,
                     long_max_new_tokens=32, stop_on_eos=False), {}),
    "random-lengths": ("padding waste: prompts of 32-256 tokens (stages 02-03)",
                       dict(num_requests=8, prompt_len_range=(32, 256), max_new_tokens=64, stop_on_eos=False), {}),
    "mixed-output": ("post 002: 1 request in 8 wants 100 tokens, the rest 10 (stage 04)",
                     dict(num_requests=32, prompt="Hello", unique_prompts=True, max_new_tokens=10, long_every=8,
                          long_max_new_tokens=100, stop_on_eos=False), {}),
    "burst": ("32 unique prompts at once (stages 06-07; use --mode streaming)",
              dict(num_requests=32, prompt="Summarise the idea of continuous batching for a new engineer, in two "
                   "sentences", unique_prompts=True, max_new_tokens=8, stop_on_eos=False),
              {"prefill_max_batch_size": 32}),
    "repeated-prompts": ("the same long prompt again and again (stage 05)",
                         dict(num_requests=32, prompt=LONG_PROMPT, max_new_tokens=8, stop_on_eos=False), {}),
    "decode-step": ("the decode step against the matmul floor: 16 rows of 160 tokens in one batch",
                    dict(num_requests=16, prompt_len_range=(160, 160), max_new_tokens=40, stop_on_eos=False),
                    {"max_batch_size": 16}),
    "shared-prefix": ("a 500-token system prompt shared by 32 distinct questions: the block-level prefix cache "
                      "(stage 10)",
                      dict(num_requests=32, shared_prefix_len=500, unique_prompts=True,
                           prompt="What is the capital of France?", max_new_tokens=32, stop_on_eos=False),
                      {"max_batch_size": 16}),
    "long-prompts": ("2,000-token prompts arriving while 16 streams decode: the streams' ITL p99 (stage 11; "
                     "use --mode streaming)",
                     dict(num_requests=16, prompt_len_range=(64, 128), max_new_tokens=96, stop_on_eos=False,
                          long_prompts=4, long_prompt_len=2000, long_prompt_interval_ms=2000.0),
                     {"max_batch_size": 16}),
    "kv-pressure": ("64 chat questions that may take 512 tokens and stop at EOS far sooner, a KV pool for 8 of them "
                    "at their worst: booking the worst case against taking blocks on demand (stage 13)",
                    dict(num_requests=64, chat_prompts=True, max_new_tokens=512, stop_on_eos=True),
                    {"max_batch_size": 64, "kv_concurrency": 8}),
}
DEFAULT_MAX_BATCH_SIZE = 8
SHARED_PREFIX_QUESTION_ROOM = 16  # tokens kept for the question after a shared prefix, when it must be cut


def workload_kwargs(args: argparse.Namespace, max_model_len: int, notes: list[str]) -> dict:
    """The workload's build_workload kwargs with the CLI overrides, fitted into the context window."""
    kw = dict(WORKLOADS[args.workload][1])
    if args.num_requests is not None:
        kw["num_requests"] = args.num_requests
    if args.max_new_tokens is not None:
        if kw.get("long_max_new_tokens"):
            kw["long_max_new_tokens"] = max(1, kw["long_max_new_tokens"] * args.max_new_tokens // kw["max_new_tokens"])
        kw["max_new_tokens"] = args.max_new_tokens
    longest_new = max(kw["max_new_tokens"], kw.get("long_max_new_tokens") or 0)
    if longest_new > max_model_len // 2:  # a tiny model: keep room for the prompt
        scale = (max_model_len // 2) / longest_new
        kw["max_new_tokens"] = max(1, int(kw["max_new_tokens"] * scale))
        if kw.get("long_max_new_tokens"):
            kw["long_max_new_tokens"] = max(1, int(kw["long_max_new_tokens"] * scale))
        notes.append(f"new tokens scaled by {scale:.2f} to fit the model's {max_model_len}-token context")
        longest_new = max(kw["max_new_tokens"], kw.get("long_max_new_tokens") or 0)
    if kw.get("prompt_len_range") and kw["prompt_len_range"][1] + longest_new > max_model_len:
        hi = max_model_len - longest_new
        kw["prompt_len_range"] = (min(kw["prompt_len_range"][0], hi), hi)
        notes.append(f"prompt lengths capped at {hi} tokens to fit the model's {max_model_len}-token context")
    if kw.get("long_prompts") and kw["long_prompt_len"] + longest_new > max_model_len:
        kw["long_prompt_len"] = max_model_len - longest_new
        notes.append(f"long prompts cut to {kw['long_prompt_len']} tokens to fit the model's "
                     f"{max_model_len}-token context")
    room = max_model_len - longest_new - SHARED_PREFIX_QUESTION_ROOM
    if kw.get("shared_prefix_len") and kw["shared_prefix_len"] > room:
        kw["shared_prefix_len"] = max(1, room)
        notes.append(f"shared prefix cut to {kw['shared_prefix_len']} tokens to fit the model's "
                     f"{max_model_len}-token context")
    return kw


def describe(name: str, kw: dict) -> str:
    if kw.get("prompt_len_range"):
        text = "random prompts {}-{} tokens".format(*kw["prompt_len_range"])
    elif kw.get("chat_prompts"):
        text = "a different chat question each"
    else:
        text = f"prompt {kw['prompt'][:40] + '...' if len(kw['prompt']) > 40 else kw['prompt']!r}"
        text += " + ' #i'" if kw.get("unique_prompts") else " (the same each time)"
    text = f"{name}: {kw['num_requests']} requests, {text}, {kw['max_new_tokens']} new tokens"
    if kw.get("shared_prefix_len"):
        text += f", after a shared prefix of {kw['shared_prefix_len']} tokens"
    if kw.get("long_every"):
        text += f" ({kw['long_max_new_tokens']} for 1 in {kw['long_every']})"
    text += ", stop on EOS" if kw.get("stop_on_eos", True) else ", EOS ignored"
    if kw.get("long_prompts"):
        text += (f"; then {kw['long_prompts']} late prompts of {kw['long_prompt_len']} tokens, one every "
                 f"{kw['long_prompt_interval_ms']:g} ms")
    return text


def auto_kv_blocks(requests: list, tokenizer, max_model_len: int, concurrency: int, block_size: int = 16) -> int:
    """Room for `concurrency` of this workload's largest requests (+1 block each for copy-on-write).

    The engines' own default is DEFAULT_TOKENS_PER_SLOT (1,024) tokens per decode slot, at least one
    full context: gigabytes per engine for a long-context model; the ladder keeps seven pools alive
    at once, so it sizes them to the work.
    """
    worst = 0
    for r in requests:
        n = len(prepare_prompt(r, tokenizer, max_model_len).token_ids)
        worst = max(worst, -(-min(n + r.params.max_new_tokens, max_model_len) // block_size) + 1)
    return concurrency * worst + concurrency
