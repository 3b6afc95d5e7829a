"""Stage 11 — chunked prefill: each step is one forward under a token budget, decode rows first, then prompt chunks.

Up to stage 10 a new request's whole prompt was prefilled between two decode steps, so one
2,000-token prompt froze every running stream for its whole prefill (stage 07's knob bounds
how many prompts, not how many tokens). Now admission only books blocks and queues the
prompt; every step packs one token per decoding session and then chunks of waiting prompts,
in arrival order, up to `max_num_batched_tokens` (vLLM's name), into one forward. A long
prompt takes several steps while the streams keep moving. This goes past the source posts.
Touches attention.py, engine.py, scheduler.py, server.py, session.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "attention.py", "engine.py", "scheduler.py", "server.py", "session.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): 16 streams (random prompts of
# 64-128 tokens, 96 new tokens) decode while 4 prompts of 2,000 tokens arrive, one every 2 s.
# Without chunks each long prompt stalls all 16 streams for its whole prefill; the streams'
# ITL p99 shows it. `make bench` runs post 052's workload on the newest stage instead.
BENCH: dict = {
    "mode": "streaming",
    "prompt_len_range": (64, 128),
    "num_requests": 16,
    "long_prompts": 4,
    "long_prompt_len": 2000,
    "long_prompt_interval_ms": 2000.0,
    "max_new_tokens": 96,
    "max_batch_size": 16,
    "max_num_batched_tokens": 256,  # the engine's default on this CPU: a chunk step costs a few decode steps
    "no_stop_on_eos": True,
    "warmup_runs": 1,
    "repeat_runs": 2,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "BlockKey", "block_keys"]
