"""Stage 04 — online scheduler: continuous batching, with a SchedulerManager worker thread that streams tokens.

Up to stage 03 a batch ran until its longest member finished. Here `OnlineScheduler` admits
a request the moment its KV blocks are free (prefill at `add_request`), decodes up to
`max_batch_size` sessions per `step()` (round-robin when it holds more), and frees a finished
session's blocks at once. `SchedulerManager` puts a worker thread in front of it: callers
`add_request` from any thread and stream text back. Touches engine.py; adds scheduler.py and
server.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "scheduler.py", "server.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): post 002's continuous-batching
# argument — 32 requests, batch 8, one request in eight wants 100 new tokens and the rest 10.
BENCH: dict = {
    "mode": "streaming",
    "num_requests": 32,
    "max_batch_size": 8,
    "max_new_tokens": 10,
    "long_every": 8,
    "long_max_new_tokens": 100,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "SchedulerManager", "RequestHandle", "StreamChunk"]
