"""Stage 03's own idea: KV in fixed-size blocks of one shared pool, read through block tables.

Cross-stage parity is in tests/test_parity.py. Here: the block allocator's bookkeeping, a
session taking a block exactly when its last one is full, packed decode attention against a
per-sequence reference, block accounting during and after a run (no block owned twice, none
leaked), and a pool too small for everyone at once — or for one request at all.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.requests import Request, SamplingParams, prepare_prompt
from conftest import stage_module

# Loaded by name: no file of a stage may `import stages...` (tests/test_diff_discipline.py).
_stage = stage_module("s03_paged_attention")
BlockAllocator, InferenceEngine, KVBlockPool, OutOfKVBlocks = (
    _stage.BlockAllocator, _stage.InferenceEngine, _stage.KVBlockPool, _stage.OutOfKVBlocks)
_attention = stage_module("s03_paged_attention.attention")
DecodeAttention, PrefillAttention = _attention.DecodeAttention, _attention.PrefillAttention


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _requests(prompts: list[list[int]], max_new: list[int], stop_on_eos: bool = True) -> list[Request]:
    return [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=n, stop_on_eos=stop_on_eos))
            for p, n in zip(prompts, max_new)]


def _assert_pool_empty(engine: InferenceEngine) -> None:
    alloc = engine.pool.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.reserved == 0
    assert alloc.ref_counts == [0] * alloc.num_blocks


def test_block_allocator_bookkeeping():
    alloc = BlockAllocator(4)
    assert (alloc.num_free, alloc.num_available, alloc.reserved) == (4, 4, 0)
    alloc.reserve(3)
    assert (alloc.num_free, alloc.num_available, alloc.reserved) == (4, 1, 3)
    with pytest.raises(OutOfKVBlocks):
        alloc.reserve(2)  # only 1 block is free and unbooked
    assert alloc.reserved == 3  # a failed reserve books nothing
    a, b = alloc.allocate(), alloc.allocate()
    assert a != b and alloc.ref_counts[a] == alloc.ref_counts[b] == 1
    assert (alloc.num_free, alloc.num_available, alloc.reserved) == (2, 1, 1)
    alloc.incref(a)  # shared by a second owner
    alloc.decref(a)
    assert alloc.ref_counts[a] == 1 and alloc.num_free == 2  # still owned: not back in the pool
    alloc.decref(a)
    assert alloc.ref_counts[a] == 0 and alloc.num_free == 3
    alloc.unreserve(1)
    alloc.decref(b)
    assert (alloc.num_free, alloc.num_available, alloc.reserved) == (4, 4, 0)
    alloc.reserve(4)  # every block comes back usable, each handed out once
    assert sorted(alloc.allocate() for _ in range(4)) == [0, 1, 2, 3]
    with pytest.raises(OutOfKVBlocks):
        alloc.reserve(1)
    assert issubclass(OutOfKVBlocks, RuntimeError)


def test_session_takes_a_block_exactly_at_block_boundaries(tiny):
    engine = InferenceEngine(tiny, block_size=4, num_kv_blocks=8)
    alloc = engine.pool.allocator
    req = Request(prompt_token_ids=_prompts([5])[0], params=SamplingParams(max_new_tokens=10))
    session = engine.new_session(req, prepare_prompt(req, tiny.tokenizer, engine.max_model_len))
    engine.reserve(session)
    assert session.reserved == alloc.reserved == math.ceil(15 / 4)
    slots = session.take_slots(5)
    t = session.block_table
    assert len(t) == 2 and alloc.num_free == 6 and session.reserved == alloc.reserved == 2
    assert slots.tolist() == [t[0] * 4 + i for i in range(4)] + [t[1] * 4]
    for n in range(6, 15):  # cache token n-1: a new block exactly when n-1 is a multiple of 4
        before = len(session.block_table)
        slot = session.take_slots(1).item()
        assert len(session.block_table) == before + ((n - 1) % 4 == 0)
        assert slot == session.block_table[(n - 1) // 4] * 4 + (n - 1) % 4
        assert session.num_cached == n
        assert alloc.num_free == 8 - len(session.block_table)
        expected = [b * 4 + i for b in session.block_table for i in range(4)][:n]
        assert session.context_slots().tolist() == expected
    assert len(set(session.block_table)) == 4 and session.reserved == 0 and alloc.reserved == 0
    session.release_kv_blocks()
    assert session.block_table == [] and session.num_cached == 0
    _assert_pool_empty(engine)


@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: large scores, the masked softmax must stay stable
@pytest.mark.parametrize("all_write", [True, False])  # False: a finished row of a static batch writes nothing
def test_decode_attention_matches_per_sequence_sdpa(scale, all_write):
    torch.manual_seed(0)
    Hq, Hkv, D, bs = 6, 2, 8, 4
    pool = KVBlockPool(SimpleNamespace(num_layers=2, num_kv_heads=Hkv, head_dim=D, max_position_embeddings=64),
                       32, bs, torch.float32, torch.device("cpu"))
    pool.k[0].zero_()  # the pool starts uninitialised (torch.empty); layer 0 must stay as we leave it
    free = torch.randperm(32).tolist()  # scattered, out-of-order blocks
    past_lens = [0, 5, 13, 3]
    B = len(past_lens)
    writes = [True] * B if all_write else [True, True, False, True]
    past = [(torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)) for n in past_lens]
    seq_slots, tables = [], []
    for n, (pk, pv) in zip(past_lens, past):
        table = [free.pop() for _ in range(-(-(n + 1) // bs))]
        pool.zero_if_fresh(table)  # as a session taking them does: their unused tails are read (masked)
        pos = torch.arange(n + 1)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        pool.write(1, slots[:n], pk, pv)
        seq_slots.append(slots)
        tables.append(table)
    nb = max(len(t) for t in tables)
    blocks = torch.tensor([t + [0] * (nb - len(t)) for t in tables])  # [B, nb], padded with block 0
    lengths = torch.tensor([n + w for n, w in zip(past_lens, writes)])
    writers = torch.tensor([b for b in range(B) if writes[b]])
    q = torch.randn(B, 1, Hq, D) * scale
    k, v = torch.randn(B, 1, Hkv, D), torch.randn(B, 1, Hkv, D)
    new_slots = torch.stack([seq_slots[b][-1] for b in writers.tolist()])
    out = DecodeAttention(pool, new_slots, blocks, lengths, None if all_write else writers)(1, q, k, v)
    assert out.shape == (B, 1, Hq, D)
    for b, (pk, pv) in enumerate(past):
        new_k, new_v = (k[b], v[b]) if writes[b] else (k[b, :0], v[b, :0])
        keys = torch.cat([pk, new_k]).transpose(0, 1)[None]  # [1, Hkv, n(+1), D]
        values = torch.cat([pv, new_v]).transpose(0, 1)[None]
        if keys.shape[2] == 0:
            continue  # nothing to attend over: the row is thrown away by the engine
        ref = F.scaled_dot_product_attention(q[b].transpose(0, 1)[None], keys, values, enable_gqa=True)  # [1, Hq, 1, D]
        torch.testing.assert_close(out[b, 0], ref[0, :, 0], rtol=1e-5, atol=1e-5)
    # The new K/V went to their slots of layer 1, and layer 0 was left alone.
    got_k, got_v = pool.gather(1, new_slots)
    torch.testing.assert_close(got_k, k[writers, 0])
    torch.testing.assert_close(got_v, v[writers, 0])
    assert pool.k[0].abs().sum() == 0


def test_prefill_attention_is_causal_and_writes_its_blocks():
    torch.manual_seed(1)
    pool = KVBlockPool(SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=8, max_position_embeddings=32),
                       8, 4, torch.float32, torch.device("cpu"))
    slots = torch.tensor([20, 21, 22, 23, 8, 9])  # blocks 5 then 2
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    out = PrefillAttention(pool, slots)(0, q, k, v)
    got_k, got_v = pool.gather(0, slots)
    torch.testing.assert_close(got_k, k[0])
    torch.testing.assert_close(got_v, v[0])
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_live_sessions_never_share_a_block_and_every_block_comes_back(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4)
    alloc = engine.pool.allocator
    seen: list[list[list[int]]] = []
    decode = engine.decode_step_sessions

    def spy(sessions):
        tables = [list(s.block_table) for s in sessions]
        flat = [b for t in tables for b in t]
        assert len(flat) == len(set(flat)), f"a block is owned twice: {tables}"
        assert all(alloc.ref_counts[b] == 1 for b in flat)
        # Only these live sessions hold blocks and bookings (finished ones already gave theirs back).
        assert len(flat) == alloc.num_blocks - alloc.num_free
        assert alloc.reserved == sum(s.reserved for s in sessions)
        seen.append(tables)
        return decode(sessions)

    engine.decode_step_sessions = spy
    prompts = _prompts([3, 17, 8, 30, 1, 12], seed=3)
    max_new = [9, 2, 14, 5, 7, 1]
    comps = engine.generate(_requests(prompts, max_new))
    assert len(seen) >= 13 and max(len(t) for t in seen) == 4
    for p, n, c in zip(prompts, max_new, comps):
        assert c.token_ids == hf_greedy(p, n)
    _assert_pool_empty(engine)


def test_request_that_can_never_fit_is_rejected_before_any_work(tiny):
    engine = InferenceEngine(tiny, block_size=4, num_kv_blocks=3)
    reqs = _requests(_prompts([3, 20], seed=4), [2, 4])  # the 2nd needs ceil(24 / 4) = 6 blocks
    with pytest.raises(ValueError, match="^prompt: a request needs 6 KV blocks"):  # 20 + 1 tokens: 6 blocks, of 3
        engine.generate(reqs)
    _assert_pool_empty(engine)
    assert engine.kv_stats()["peak_blocks_in_use"] == 0


def test_pool_for_one_request_at_a_time_still_serves_everyone(tiny, hf_greedy):
    # Worst cases (block_size 4): ceil(14/4)=4, ceil(15/4)=4, ceil(17/4)=5, ceil(12/4)=3; any two exceed 5.
    engine = InferenceEngine(tiny, max_batch_size=4, block_size=4, num_kv_blocks=5)
    batch_sizes: list[int] = []
    decode = engine.decode_step_sessions
    engine.decode_step_sessions = lambda sessions: batch_sizes.append(len(sessions)) or decode(sessions)
    prompts = _prompts([9, 10, 12, 7], seed=5)
    comps = engine.generate(_requests(prompts, [5] * 4, stop_on_eos=False))
    assert batch_sizes == [1] * 16  # four requests, one after another, 4 decode steps each
    for p, c in zip(prompts, comps):
        assert c.token_ids == hf_greedy(p, 5)
    for before, after in zip(comps, comps[1:]):
        assert after.token_timestamps[0] > before.token_timestamps[-1]
    assert engine.kv_stats()["peak_blocks_in_use"] <= 5
    _assert_pool_empty(engine)


def test_kv_stats(tiny):
    cfg = tiny.config
    engine = InferenceEngine(tiny, block_size=4, kv_cache_max_concurrency=2)
    engine.generate(_requests(_prompts([8], seed=6), [9], stop_on_eos=False))
    stats = engine.kv_stats()
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    assert stats["block_size"] == 4
    assert stats["num_blocks"] == 2 * math.ceil(cfg.max_position_embeddings / 4)  # two full contexts
    assert stats["pool_kv_bytes"] == stats["num_blocks"] * per_block
    # 8 prompt + 9 new tokens: at most 16 tokens are ever cached (the last one is never fed back) = 4 blocks.
    assert stats["peak_blocks_in_use"] == 4
    assert stats["peak_kv_bytes"] == 4 * per_block
    with pytest.raises(ValueError, match="num_kv_blocks"):
        InferenceEngine(tiny, num_kv_blocks=4, kv_cache_max_concurrency=1)


@pytest.mark.parametrize("block_size", [1, 7])
def test_odd_block_sizes_keep_parity(tiny, hf_greedy, block_size):
    engine = InferenceEngine(tiny, max_batch_size=3, block_size=block_size)
    prompts = _prompts([1, 7, 8, 15, 30], seed=7 + block_size)
    max_new = [5, 8, 3, 10, 6]
    for p, n, c in zip(prompts, max_new, engine.generate(_requests(prompts, max_new))):
        assert c.token_ids == hf_greedy(p, n)
    _assert_pool_empty(engine)
