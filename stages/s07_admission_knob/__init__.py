"""Stage 07 — admission knob: `prefill_max_batch_size` decides how many pending requests one worker iteration admits, apart from the decode batch size.

In stage 06 the worker drained at most `max_batch_size` pending requests per iteration — the
same number that sizes every decode step — so a burst larger than the decode batch waited
several iterations for its prefill. `SchedulerManager(..., prefill_max_batch_size=None)`
decouples the two (post 030): None keeps the old behaviour; 32 admits a burst of 32 in one
batched prefill while decode still runs 8 at a time. Touches server.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import PrefixCache, PrefixCacheEntry, PrefixCacheKey

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "server.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): post 030's experiment — 32 unique
# "Hello" prompts, 8 new tokens, decode batch 8, and the burst admitted in one prefill of 32.
BENCH: dict = {
    "mode": "streaming",
    "prompt": "Hello",
    "unique_prompts": True,
    "num_requests": 32,
    "max_new_tokens": 8,
    "max_batch_size": 8,
    "prefill_max_batch_size": 32,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "PrefixCacheEntry", "PrefixCacheKey"]
