"""Stage 03 — paged attention: KV lives in fixed-size blocks from one shared pool, found through block tables.

Stage 02 reserved a contiguous `[B, longest + max_new]` cache per batch, so short rows paid
for the longest one. Here each request is an `InferenceSession` owning a block table into a
shared `KVBlockPool`; it takes a block only when its last one is full, and decode copies each
session's blocks into one reused buffer and attends over it in one call per layer. Still static
batching.
Touches engine.py, attention.py and kv_cache.py; adds session.py.
"""

from .engine import InferenceEngine
from .session import InferenceSession
from .kv_cache import BlockAllocator, BlockTables, KVBlockPool, OutOfKVBlocks

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "attention.py", "engine.py", "kv_cache.py", "session.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): prompts of very different lengths
# (16-256 tokens), so stage 02's per-batch rectangle — every row as long as the longest — holds
# far more KV memory than the blocks the same rows really fill ("Peak KV" in the comparison).
BENCH: dict = {
    "mode": "offline",
    "num_requests": 16,
    "max_new_tokens": 16,
    "prompt_len_range": (16, 256),
    "max_batch_size": 8,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine", "InferenceSession", "BlockAllocator", "BlockTables", "KVBlockPool", "OutOfKVBlocks"]
