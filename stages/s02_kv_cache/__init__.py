"""Stage 02 — KV cache: prefill each batch once into a contiguous KV cache, then decode one token per step.

Stage 01 recomputed every token's keys and values at every step. Here the prompt is run
once (the *prefill*), its K/V are kept in a contiguous per-batch cache sized for the
batch's worst case, and each later step feeds only the newest token (the *decode*).
Batching is unchanged: static batches, finished rows wait. Touches engine.py and
attention.py, and adds kv_cache.py.
"""

from .engine import InferenceEngine

# Files that differ from the previous stage.
CHANGES: list[str] = ["__init__.py", "engine.py", "attention.py", "kv_cache.py", "test_stage.py"]

# Default workload of this stage's benchmark (flags override): small enough for a laptop CPU.
BENCH: dict = {
    "mode": "offline",
    "num_requests": 8,
    "max_new_tokens": 16,
    "prompt_len_range": (16, 64),
    "max_batch_size": 8,
    "no_stop_on_eos": True,
}

__all__ = ["InferenceEngine"]
