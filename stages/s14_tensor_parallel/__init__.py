"""Stage 14 — tensor parallelism: one model split across ranks on torch.distributed, Megatron-style.

Every layer is split by heads and by the MLP's inner width across `tensor_parallel_size` ranks
(vLLM's name): column-parallel q/k/v and gate/up projections, row-parallel output and down
projections with one all-reduce each, the embedding and the LM head split by vocabulary; each
rank reads only its share from the checkpoint (sharding.py) and keeps the KV blocks of its own
KV heads. The scheduler runs on rank 0 and sends each step's inputs to the other ranks
(parallel.py); gloo between CPU processes, NCCL between GPUs. Launched as one process the
engine starts the other ranks itself; under torchrun they come up on any number of machines.
At size 1 it is stage 13. Touches cuda_graphs.py, engine.py, parallel.py and sharding.py (new).
"""

from .cuda_graphs import DecodeGraphs
from .engine import InferenceEngine
from .session import InferenceSession
from .scheduler import OnlineRequest, OnlineScheduler
from .server import RequestHandle, SchedulerManager, StreamChunk
from .kv_cache import BlockAllocator, KVBlockPool, OutOfKVBlocks
from .prefix_cache import BlockKey, PrefixCache, block_keys

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "__main__.py", "cuda_graphs.py", "engine.py", "parallel.py", "sharding.py",
                       "test_stage.py"]

# Default workload of this stage's benchmark (flags override): 16 streams of 64 new tokens at
# once, one decode batch, at tensor_parallel_size 3, the one split SmolLM2 allows (9 heads, 3 KV
# heads): on a CPU the point is the tokens and the cost of communication, not speed (the three
# ranks share the same cores). `make bench` runs post 052's workload on the newest stage instead.
BENCH: dict = {
    "mode": "streaming",
    "prompt_len_range": (32, 32),
    "num_requests": 16,
    "max_new_tokens": 64,
    "max_batch_size": 16,
    "no_stop_on_eos": True,
    "tensor_parallel_size": 3,
    "warmup_runs": 1,
    "repeat_runs": 2,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "KVBlockPool", "OutOfKVBlocks",
           "OnlineScheduler", "OnlineRequest", "SchedulerManager", "RequestHandle", "StreamChunk",
           "PrefixCache", "BlockKey", "block_keys", "DecodeGraphs"]
