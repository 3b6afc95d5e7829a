"""Stage 05 — prefix cache: a repeated prompt reuses its KV blocks and last logits instead of being prefilled again.

Stage 04 prefilled every request, even the hundredth copy of the same system prompt. Here
`PrefixCache` (an LRU keyed by the prompt string, at most `prefix_cache_max_entries`) keeps
each prompt's ref-counted KV blocks and last logits; `attach` hands them to a new session
(no forward pass) and `put` stores them after a prefill. A session copies a shared block
before writing into it. Touches engine.py, kv_cache.py and session.py; adds prefix_cache.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import PrefixCache, PrefixCacheEntry, PrefixCacheKey

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "kv_cache.py", "prefix_cache.py", "session.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): the same long prompt, again and
# again — every request after the first is a prefix-cache hit.
BENCH: dict = {
    "mode": "streaming",
    "prompt": (
        "You are a careful assistant. Answer briefly and precisely. Here is the context for every "
        "question today: the stagewise engine is built in nine stages; each stage adds one idea to the "
        "previous one — a KV cache, paged attention, continuous batching, a prefix cache, batched prefill, "
        "an admission knob, token-id cache keys and batched worker lookups. Question: what does stage five add?"
    ),
    "num_requests": 32,
    "max_new_tokens": 8,
    "max_batch_size": 8,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "PrefixCacheEntry", "PrefixCacheKey"]
