"""PrefixCache: reuse a prompt's KV blocks and last logits when the same prompt comes again.

An entry is keyed by the prompt string (as in the post) and holds the prompt's block table —
the blocks stay ref-counted, so the cache and every session using them share one copy — and
the logits of the prompt's last token, so a hit needs no forward pass at all: sample the first
token from the cached logits and go straight to decode. At most `max_entries` entries live in
an LRU (`OrderedDict`); evicting one drops the cache's reference, and a block goes back to the
pool only when no session still uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.requests import int_knob

from .kv_cache import KVBlockPool

if TYPE_CHECKING:
    from .session import InferenceSession

PrefixCacheKey = str


@dataclass
class PrefixCacheEntry:
    block_table: list[int]  # the prompt's blocks; the cache holds one reference to each
    prompt_ids: tuple[int, ...]  # what was prefilled: slots [0, len(prompt_ids)) of the table are valid
    last_logits: torch.Tensor  # [V] logits of the prompt's last token


class PrefixCache:
    """LRU of prompt -> (KV blocks, last logits); 0 entries disables it."""

    def __init__(self, pool: KVBlockPool, max_entries: int) -> None:
        int_knob("prefix_cache_max_entries", max_entries, 0)
        self.pool = pool
        self.max_entries = int(max_entries)
        self._entries: OrderedDict[PrefixCacheKey, PrefixCacheEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PrefixCacheKey) -> bool:
        return key in self._entries

    def attach(self, key: PrefixCacheKey, session: "InferenceSession") -> torch.Tensor | None:
        """On a hit, give the session the cached blocks (shared, read-only) and return the cached logits [V]."""
        entry = self._entries.get(key) if self.max_entries else None
        # The same key must mean the same tokens: a text key with different token ids (a caller's
        # own tokenization) would otherwise reuse the wrong K/V. Such a lookup is a miss.
        if entry is None or entry.prompt_ids != tuple(session.prompt_ids):
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        session.attach_blocks(entry.block_table, len(entry.prompt_ids))
        return entry.last_logits.clone()  # the caller may sample from it in place

    def put(self, key: PrefixCacheKey, session: "InferenceSession", last_logits: torch.Tensor) -> None:
        """After a prefill: remember the session's prompt blocks (one more reference each) and logits [V]."""
        if not self.max_entries:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        n_blocks = -(-session.num_cached // self.pool.block_size)
        blocks = session.block_table[:n_blocks]
        for block in blocks:
            self.pool.allocator.incref(block)
        self._entries[key] = PrefixCacheEntry(blocks, tuple(session.prompt_ids), last_logits.detach().clone())
        while len(self._entries) > self.max_entries:
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        _, entry = self._entries.popitem(last=False)
        for block in entry.block_table:
            self.pool.allocator.decref(block)  # back to the pool only if no session still holds it
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
