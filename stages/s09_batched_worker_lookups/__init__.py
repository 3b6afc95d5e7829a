"""Stage 09 — batched worker lookups: the worker takes its lock once per decode step instead of once per token.

Up to stage 08, `_run_decode_once` (the post's `run_decode_once`) pushed each of a step's
tokens to its request with its own `with self._lock:` — batch-size lock acquisitions per step,
each one a chance to collide with `add_request` callers. Now one acquisition collects every
request's queue, detokenizer and stream state; detokenizing, flushing and `put` happen outside
the lock (post 052). Touches server.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import PrefixCache, PrefixCacheEntry, PrefixCacheKey

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "server.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): post 052's shape — 64 requests
# submitted every 20 ms on an absolute schedule, 128 new tokens, batch 64, pre-tokenized, streamed
# every 8 tokens, no prefix cache — so add_request and decode steps overlap for real.
BENCH: dict = {
    "mode": "streaming",
    "prompt": "Hello",
    "pretok": True,
    "stream_interval": 8,
    "num_requests": 64,
    "submit_interval_ms": 20.0,
    "submit_schedule": "absolute",
    "max_new_tokens": 128,
    "max_batch_size": 64,
    "prefill_max_batch_size": 64,
    "no_stop_on_eos": True,
    "no_prefix_cache": True,
    "warmup_runs": 1,
    "repeat_runs": 2,  # `make bench` runs this workload: keep it to a few minutes on a 2-core CPU
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "PrefixCacheEntry", "PrefixCacheKey"]
