"""Stage 12 — CUDA graphs: a decode step is captured once per padded batch size and replayed every step.

On a GPU an eager decode step is bound by the host, not the chip: Python launches a few hundred
small kernels one after the other (on an H200, stage 09's step took 4.3 ms for under 1 ms of
kernels). Now the engine captures its decode step as a CUDA graph for each bucket of batch
size (1, 2, 4, 8, then every 16) and block-table width (powers of two), once, at start, and a
decode-only step copies its inputs into the graph's static buffers and replays it with one
launch. Padded rows write into a scratch block no sequence owns. Steps with prompt chunks run
eagerly, as in stage 11; so does everything on a CPU, unless `enforce_eager=False`. This goes
past the source posts. Touches cuda_graphs.py (new), engine.py, kv_cache.py.
"""

from .cuda_graphs import DecodeGraphs
from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "cuda_graphs.py", "engine.py", "kv_cache.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): 64 short prompts at once, 128 new
# tokens each, one decode batch of 64: a run that is decode steps, where a graph replaces the
# launches (on a GPU; on a CPU stage 12 runs stage 11's eager step). `make bench` runs post 052's
# workload on the newest stage instead.
BENCH: dict = {
    "mode": "streaming",
    "prompt_len_range": (16, 16),
    "num_requests": 64,
    "max_new_tokens": 128,
    "max_batch_size": 64,
    "no_stop_on_eos": True,
    "warmup_runs": 1,
    "repeat_runs": 2,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "BlockKey", "block_keys", "DecodeGraphs"]
