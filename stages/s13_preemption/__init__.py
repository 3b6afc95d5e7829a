"""Stage 13 — preemption: KV blocks taken as sequences grow, and a request preempted by recompute when the pool runs dry.

Up to stage 12 admission booked a request's worst case, prompt + max_new_tokens, so a request
that stops at EOS after 60 of its 512 tokens held 512 tokens of the pool all its life, and the
batch stayed as small as if every request ran to its limit. Now admission books only the
prompt's blocks, a decode step takes a block when a sequence's last one fills, and when the
pool runs dry the most recently admitted request is preempted: its blocks go back (its full
ones into the prefix cache), its tokens stay, and it is prefilled again over prompt +
generated tokens once there is room, token for token as if it had never stopped. This is
paging's own payoff (vLLM's recompute preemption). Touches engine.py, kv_cache.py,
scheduler.py, server.py, session.py.
"""

from .cuda_graphs import DecodeGraphs
from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "kv_cache.py", "scheduler.py", "server.py", "session.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): 64 different chat questions that
# may each take 512 tokens; SmolLM2 answers and stops at EOS far sooner. The KV pool holds 8 of
# them at their worst (8 x 35 blocks of 16 tokens), so stage 12, booking the worst case, runs 8
# at a time, and this stage as many as the blocks they really use. Streams are flushed every 8
# tokens, as in post 052 and `make bench`: at one token a flush, the benchmark's own client
# threads wake once per token and, on a 2-core CPU, take turns with the engine's, a cost that
# grows with the requests a step (the tokens' timestamps are still taken one by one, at sampling).
# `make bench` runs post 052's workload on the newest stage instead.
BENCH: dict = {
    "mode": "streaming",
    "chat_prompts": True,
    "num_requests": 64,
    "max_new_tokens": 512,
    "max_batch_size": 64,
    "num_kv_blocks": 280,
    "stream_interval": 8,
    "warmup_runs": 1,
    "repeat_runs": 2,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "BlockKey", "block_keys", "DecodeGraphs"]
