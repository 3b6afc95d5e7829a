"""Stage 10 — block-level prefix cache: a prompt reuses every cached full KV block of its prefix, not only a whole repeated prompt.

Stage 05's cache (through 09) keyed whole prompts: two chat requests that share a 500-token
system prompt and differ in the question reused nothing. Now each full block is keyed by a
hash of its token ids chained with the previous block's key, as in vLLM and nano-vllm; a new
prompt takes the longest run of leading blocks the pool still holds and prefills only the
rest. Cached blocks nobody uses stay in the pool as evictable (LRU) until new data needs
them. The prefill packs every prompt's uncached tokens into one row, each attending to its
cached blocks. This goes past the source posts. Touches kv_cache.py, prefix_cache.py,
attention.py, engine.py, session.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "attention.py", "engine.py", "kv_cache.py", "prefix_cache.py", "session.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): 32 chat-like requests that share
# a 500-token "system prompt" and differ in the question, arriving as one burst, batch 16. Stage
# 09's whole-prompt cache gets no hit here; this stage prefills the shared blocks once.
# `make bench` runs post 052's workload on the newest stage instead (`--preset post-052`).
BENCH: dict = {
    "mode": "streaming",
    "prompt": "What is the capital of France?",
    "unique_prompts": True,
    "shared_prefix_len": 500,
    "num_requests": 32,
    "max_new_tokens": 32,
    "max_batch_size": 16,
    "no_stop_on_eos": True,
    "warmup_runs": 1,
    "repeat_runs": 2,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "BlockKey", "block_keys"]
