"""Benchmark workloads: the same list of requests for every engine in a comparison.

Each workload isolates one effect from the posts:
- fixed prompt ("Hello", post 030): every request is the same, so batching is all that matters;
- `unique_prompts`: a per-request suffix makes every prompt *text* different (defeats a
  string-keyed prefix cache);
- `pretok_base_token_ids` (post 004): texts differ but token ids are equal (a token-id-keyed
  cache should hit);
- `prompt_len_range`: random prompt token ids of random length (realistic padding waste);
- `long_every` (post 002): one request in `long_every` wants many more tokens than the rest --
  the case where static batching idles and continuous batching wins;
- `shared_prefix_len` / `repeat_prompts`: material for prefix caching;
- `chat_prompts` (stage 13): a different short question per request, in the model's chat
  template: an instruct model answers each in its own length and stops at EOS, so requests
  that may ask for hundreds of tokens end after tens (the waste a worst-case KV booking pays);
- `long_prompts` (stage 11): K prompts of `long_prompt_len` random token ids that arrive late,
  one every `long_prompt_interval_ms`, while the ordinary requests decode. Their planned arrival
  is on the request (`Request.submit_offset_s`); the streaming runners honour it.
Everything random comes from one seeded RNG, so a workload is reproducible from its flags.
"""
from __future__ import annotations

import hashlib
import json

import copy
import math
import random

from common.requests import Request, SamplingParams
from common.tokenizer import chat_prompt, encode

# The questions of `chat_prompts`: topic x ask, so that every request of a burst of up to 64 differs.
CHAT_TOPICS = ("photosynthesis", "the moon's phases", "a hash table", "inflation", "volcanoes", "the immune system",
               "binary search", "the French Revolution", "rainbows", "a CPU cache", "compound interest",
               "plate tectonics", "vaccines", "the printing press", "black holes", "recursion")
CHAT_ASKS = ("What is {}?", "Explain {} to a child.", "Give two facts about {}.", "Why does {} matter?")


def ordinary_token_range(tokenizer) -> tuple[int, int, frozenset[int]]:
    """[lo, hi) ids that are plain text pieces: skips the low ids (control/byte tokens in most
    BPE vocabularies), added tokens past `vocab_size`, and every special token."""
    vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
    special = frozenset(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    lo = min(1000, vocab // 4)
    if vocab - lo <= len(special):
        raise ValueError("tokenizer: vocabulary too small for random prompts")
    return lo, vocab, special


def model_token_range(vocab: int) -> tuple[int, int, frozenset[int]]:
    """[lo, hi) for prompts that only have to be tokens to the model (the profilers' and parity's
    random prompts): any id past the first 100, special ones included. Kept apart from
    `ordinary_token_range` so that their committed results draw the same prompts again."""
    return min(100, vocab - 1), vocab, frozenset()


def random_token_ids(rng: random.Random, n: int, lo: int, hi: int, special: frozenset[int]) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        tid = rng.randrange(lo, hi)
        if tid not in special:
            ids.append(tid)
    return ids


def _check(name: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def build_workload(
    tokenizer,
    *,
    prompt: str = "Hello",
    num_requests: int,
    unique_prompts: bool = False,
    prompt_len_range: tuple[int, int] | None = None,
    max_new_tokens: int,
    long_every: int | None = None,
    long_max_new_tokens: int | None = None,
    shared_prefix_len: int | None = None,
    repeat_prompts: int | None = None,
    stop_on_eos: bool = True,
    seed: int = 0,
    pretok: bool = False,
    pretok_base_token_ids: bool = False,
    long_prompts: int | None = None,
    long_prompt_len: int = 2000,
    long_prompt_interval_ms: float = 2000.0,
    chat_prompts: bool = False,
) -> list[Request]:
    """Build `num_requests` greedy requests (see the module docstring for each knob), then
    `long_prompts` late ones: request num_requests + k (k = 0..K-1) is `long_prompt_len` random
    ordinary token ids, planned at (k + 1) * long_prompt_interval_ms after the start, with the
    same max_new_tokens as the others. They are drawn after the ordinary prompts, so adding
    them leaves the ordinary requests as they were.

    Prompt ids are filled in (`prompt_token_ids`) when `pretok`, and always for random-length
    or shared-prefix prompts, which only exist as ids; their `prompt` text is the decoded ids, so
    engines that key on text still see distinct prompts. Request i uses distinct prompt
    i // repeat_prompts, so the k copies of a prompt arrive back to back.
    """
    _check("num_requests", num_requests, 1)
    _check("max_new_tokens", max_new_tokens, 1)
    _check("long_every", long_every, 1)
    _check("long_max_new_tokens", long_max_new_tokens, 1)
    _check("shared_prefix_len", shared_prefix_len, 0)
    _check("repeat_prompts", repeat_prompts, 1)
    _check("long_prompts", long_prompts, 0)
    if long_prompts:
        if long_prompt_len is None or long_prompt_len < 1:
            raise ValueError(f"long_prompt_len: must be >= 1 with long_prompts, got {long_prompt_len}")
        if not isinstance(long_prompt_interval_ms, (int, float)) or not 0 <= long_prompt_interval_ms < math.inf:
            raise ValueError(f"long_prompt_interval_ms: must be a finite number >= 0, got {long_prompt_interval_ms!r}")
    if prompt_len_range is not None:
        lo_len, hi_len = (int(x) for x in prompt_len_range)
        if not 1 <= lo_len <= hi_len:
            raise ValueError(f"prompt_len_range: need 1 <= min <= max, got {prompt_len_range}")
    if chat_prompts and prompt_len_range is not None:  # two kinds of prompt: one would be dropped without a word
        raise ValueError(f"chat_prompts: cannot go with prompt_len_range {prompt_len_range} (random token prompts); "
                         f"choose one")
    if chat_prompts and shared_prefix_len:
        raise ValueError("chat_prompts: cannot go with shared_prefix_len (the questions share no prefix); choose one")
    if shared_prefix_len and prompt_len_range is not None and min(prompt_len_range) <= shared_prefix_len:
        # a random prompt's length counts its prefix: one no longer than the prefix would be cut to prefix + 1 token
        raise ValueError(f"prompt_len_range: {tuple(prompt_len_range)} counts the shared prefix of {shared_prefix_len} "
                         f"tokens, so its lengths must exceed it")
    if long_max_new_tokens is not None and long_every is None:
        raise ValueError("long_max_new_tokens: only used with long_every (which requests are the long ones)")
    if not prompt and prompt_len_range is None:
        raise ValueError("prompt: empty prompt")
    if pretok_base_token_ids and not pretok:
        raise ValueError("pretok_base_token_ids: only meaningful with pretok=True (as in post 004)")

    rng = random.Random(seed)
    prefix_ids: list[int] = []
    if shared_prefix_len or prompt_len_range is not None:
        lo, hi, special = ordinary_token_range(tokenizer)
    if shared_prefix_len:
        prefix_ids = random_token_ids(rng, shared_prefix_len, lo, hi, special)

    num_distinct = math.ceil(num_requests / (repeat_prompts or 1))
    distinct: list[tuple[str, list[int] | None]] = []
    for j in range(num_distinct):
        if prompt_len_range is not None:
            length = rng.randint(lo_len, hi_len)
            tail = random_token_ids(rng, max(1, length - len(prefix_ids)), lo, hi, special)
            ids: list[int] | None = prefix_ids + tail
            text = tokenizer.decode(ids)
        elif chat_prompts:
            question = CHAT_ASKS[j // len(CHAT_TOPICS) % len(CHAT_ASKS)].format(CHAT_TOPICS[j % len(CHAT_TOPICS)])
            text = chat_prompt(tokenizer, question + (f" (#{j})" if j >= len(CHAT_TOPICS) * len(CHAT_ASKS) else ""))
            ids = encode(tokenizer, text) if pretok else None
        else:
            text = f"{prompt} #{j}" if unique_prompts else prompt
            if prefix_ids:
                ids = prefix_ids + encode(tokenizer, text)
                text = tokenizer.decode(prefix_ids) + text
            elif pretok:
                ids = encode(tokenizer, prompt if pretok_base_token_ids else text)
            else:
                ids = None
        distinct.append((text, ids))

    requests = []
    for i in range(num_requests):
        text, ids = distinct[i // (repeat_prompts or 1)]
        is_long = long_every is not None and i % long_every == 0
        n_new = (long_max_new_tokens or 10 * max_new_tokens) if is_long else max_new_tokens
        params = SamplingParams(max_new_tokens=n_new, stop_on_eos=stop_on_eos)
        requests.append(Request(prompt=text, prompt_token_ids=None if ids is None else list(ids), params=params))
    if long_prompts:
        lo, hi, special = ordinary_token_range(tokenizer)
        for k in range(long_prompts):
            ids = random_token_ids(rng, long_prompt_len, lo, hi, special)
            requests.append(Request(prompt=tokenizer.decode(ids), prompt_token_ids=ids,
                                    params=SamplingParams(max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos),
                                    submit_offset_s=(k + 1) * long_prompt_interval_ms / 1000.0))
    return requests


def fresh_copies(requests: list[Request]) -> list[Request]:
    """Deep copies, so no engine can see (or mutate) state another engine left on a request."""
    return copy.deepcopy(requests)


def workload_digest(requests: list) -> str:
    """A fingerprint of a workload, so the parent can check the child rebuilt the same requests."""
    rows = [[r.prompt, r.prompt_token_ids, r.params.max_new_tokens, r.params.stop_on_eos, r.submit_offset_s]
            for r in requests]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
