"""Stage 01 — naive batching: static batches of requests, and every step recomputes the whole sequence.

The baseline. Requests are cut into static batches of up to `max_batch_size`; each batch is
left-padded into one rectangle and, for every new token, the model runs over *all* tokens so
far (there is no KV cache). A batch runs until its longest member is done — finished rows wait —
and only then does the next batch start. Every later stage removes one of these wastes.
"""

from .engine import InferenceEngine

# Files that differ from the previous stage (the baseline has none to differ from).
CHANGES: list[str] = []

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
