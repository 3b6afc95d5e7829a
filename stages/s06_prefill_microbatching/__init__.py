"""Stage 06 — prefill micro-batching: a burst of new requests is prefilled in one batched forward, duplicates once.

Up to stage 05 every admitted request cost one prefill forward, so a burst of 32 waited for
32 forwards in a row. Here `OnlineScheduler.add_requests` admits a list: the prefix cache is
consulted first, identical keys inside the burst are prefilled once and shared, and the rest
run as one right-padded batch. The SchedulerManager worker drains up to `max_batch_size`
pending requests per iteration into one `add_requests` call. Touches engine.py,
attention.py, scheduler.py and server.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import PrefixCache, PrefixCacheEntry, PrefixCacheKey

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "attention.py", "scheduler.py", "server.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): a burst of 32 unique prompts at
# once — stage 05 prefills them one forward each, this stage a few batched forwards.
BENCH: dict = {
    "mode": "streaming",
    "prompt": "Summarise the idea of continuous batching for a new engineer, in two sentences",
    "unique_prompts": True,
    "num_requests": 32,
    "max_new_tokens": 8,
    "max_batch_size": 8,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "PrefixCacheEntry", "PrefixCacheKey"]
