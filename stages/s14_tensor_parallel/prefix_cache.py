"""PrefixCache over KV blocks: any shared run of leading full blocks is reused, not only a whole prompt.

Stage 05's cache keyed a whole prompt, so two chat requests that share a 500-token system
prompt and differ in the question reused nothing. Here every *full* block of a prompt gets a
key: its token ids chained with the key of the block before it (vLLM's and nano-vllm's block
hash). Equal keys mean equal tokens *and* an equal prefix before them, so equal K/V: a new
prompt walks its keys from the first block and takes every block the cache knows, then
prefills only the rest.

The cache holds no references. A cached block lives in the pool like any other: while some
session uses it, it is pinned by that session's reference; when the last one lets go it joins
the allocator's evictable LRU, still findable, until `allocate` needs it for new data
(`BlockAllocator.forget` tells us, and its key goes). So eviction costs nothing until the
pool is full, and an unreferenced cached block is exactly a free block that still remembers.

Only full blocks are cached: a partial last block is still being written by its session.
Since nobody ever writes into a full block, shared blocks need no copy-on-write.
"""

from __future__ import annotations

from .kv_cache import KVBlockPool

# A block's key: hash of (the previous block's key, this block's token ids). Python's hash of
# a tuple of ints is deterministic across runs; the stored token ids are compared on every
# match, so a collision could only alias two prefixes whose *parents* collided (64-bit; vLLM
# offers sha256 for the same reason).
BlockKey = int
NO_PARENT: BlockKey = -1


def block_keys(token_ids: list[int], block_size: int) -> list[BlockKey]:
    """Chained keys of the full blocks of `token_ids`: key i covers tokens [0, (i + 1) * block_size)."""
    keys, parent = [], NO_PARENT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


class PrefixCache:
    """Key -> block for every full prompt block computed so far (while the pool still holds it)."""

    def __init__(self, pool: KVBlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = bool(enabled)
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._ids_of: dict[int, tuple[int, ...]] = {}
        pool.allocator.on_evict = self._forget
        self.hits = 0  # requests that reused at least one block
        self.misses = 0  # requests that reused none
        self.hit_tokens = 0  # prompt tokens whose K/V came from the cache
        self.query_tokens = 0  # prompt tokens looked up

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self._block_of)

    def match(self, token_ids: list[int], keys: list[BlockKey], pending: dict[BlockKey, int] | None = None) -> list[int]:
        """The longest run of leading blocks whose K/V exist: in the cache, or in `pending`
        (blocks an earlier prompt of the same prefill writes). At most (len - 1) // block_size
        blocks: the last prompt token is always computed, since its logits are what we sample from."""
        if not self.enabled:
            return []
        bs = self.pool.block_size
        found: list[int] = []
        for i, key in enumerate(keys[: (len(token_ids) - 1) // bs]):
            block = self._block_of.get(key)
            if block is not None and self._ids_of[block] != tuple(token_ids[i * bs:(i + 1) * bs]):
                block = None  # a key collision: never reuse someone else's K/V
            if block is None and pending is not None:
                block = pending.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def count(self, prompt_len: int, hit_blocks: int) -> None:
        """Statistics of one admitted prompt."""
        self.hits += hit_blocks > 0
        self.misses += hit_blocks == 0
        self.hit_tokens += hit_blocks * self.pool.block_size
        self.query_tokens += prompt_len

    def insert(self, token_ids: list[int], keys: list[BlockKey], block_table: list[int]) -> None:
        """After a prefill: remember the prompt's full blocks (keys already known are kept as they are)."""
        if not self.enabled:
            return
        bs = self.pool.block_size
        for i, key in enumerate(keys):
            if key in self._block_of or block_table[i] in self._key_of:
                continue
            block = block_table[i]
            self._block_of[key] = block
            self._key_of[block] = key
            self._ids_of[block] = tuple(token_ids[i * bs:(i + 1) * bs])
            self.pool.allocator.cached.add(block)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._ids_of[block]

    def clear(self) -> None:
        """Forget every cached block; those nobody holds go back to the plain free list."""
        for block in list(self._key_of):
            self.pool.allocator.forget(block)
