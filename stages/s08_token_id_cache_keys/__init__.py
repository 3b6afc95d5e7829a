"""Stage 08 — token-id cache keys: the prefix cache and in-batch dedup key a request by its token ids when it has them.

Up to stage 07 the key was the prompt string, so requests whose text differed but whose
`prompt_token_ids` were equal were prefilled again and again. Now `PrefixCacheKey = str |
tuple[int, ...]`: a request carrying token ids is keyed by the tuple of its last
`max_position_embeddings` ids (the same truncation as the prefill); attach, put and the
in-batch dedup all use that key (post 004). Touches engine.py and prefix_cache.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import PrefixCache, PrefixCacheEntry, PrefixCacheKey

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "prefix_cache.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): post 004's experiment — 32 requests
# whose texts all differ (--unique-prompts) but whose pre-tokenized ids are equal
# (--pretok --pretok-base-token-ids), one new token each, batch 32. The post's prompt was "Hello";
# on a CPU a one-token prefill of 32 rows costs about what one row costs (reading the weights
# dominates), so we give the prompt a sentence's worth of tokens for the prefill to matter.
BENCH: dict = {
    "mode": "streaming",
    "prompt": "Summarise this support ticket in one sentence and suggest who should handle it",
    "unique_prompts": True,
    "pretok": True,
    "pretok_base_token_ids": True,
    "num_requests": 32,
    "max_new_tokens": 1,
    "max_batch_size": 32,
    "prefill_max_batch_size": 32,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "PrefixCacheEntry", "PrefixCacheKey"]
