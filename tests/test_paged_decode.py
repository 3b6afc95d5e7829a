"""The paged decode path of every stage from 03 on: the device mirror of the block tables stays
true to the sessions' own lists, and a decode step allocates no per-layer buffer of its own.

The mirror (`pool.tables`) is what the kernels read; the sessions' Python lists are what the
allocator trusts. If they ever disagree, attention reads another sequence's K/V and the output is
quietly wrong, so it is checked before every decode step, through prefix-cache hits, in-batch
duplicates and copy-on-write (stages 05+), with blocks freed and reused in between.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams
from conftest import STAGE_DIRS, stage_module

PAGED = [s for s in STAGE_DIRS if int(s[1:3]) >= 3]


def _check_mirror(engine, sessions) -> None:
    tables = engine.pool.tables
    rows = [s.row for s in sessions if not s.finished]
    assert len(rows) == len(set(rows)), "two live sessions share a row of the block-table mirror"
    for s in sessions:
        if s.finished:
            continue
        n = len(s.block_table)
        assert tables.table[s.row, :n].tolist() == s.block_table
        assert int(tables.lengths[s.row]) == s.num_cached


@pytest.mark.parametrize("stage", PAGED)
def test_block_table_mirror_matches_every_session_before_every_step(tiny, hf_greedy, stage):
    engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=3, block_size=4)
    # Stage 11 decodes inside step_sessions(decode, prefilling): one forward for decode rows and prompt chunks.
    name = "step_sessions" if hasattr(engine, "step_sessions") else "decode_step_sessions"
    decode = getattr(engine, name)
    steps = []

    def spy(sessions, *rest):
        _check_mirror(engine, sessions)
        steps.append(len(sessions))
        return decode(sessions, *rest)

    setattr(engine, name, spy)
    rng = random.Random(11)
    distinct = [[rng.randrange(100, 40000) for _ in range(n)] for n in (6, 13, 3, 9)]
    # Repeats and duplicates: prefix-cache hits, in-batch dedup and copy-on-write in 05+.
    prompts = [distinct[i] for i in (0, 1, 0, 2, 1, 3, 0, 3)]
    max_new = [5, 9, 2, 7, 4, 6, 8, 3]
    reqs = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=n, stop_on_eos=False))
            for p, n in zip(prompts, max_new)]
    for p, n, c in zip(prompts, max_new, engine.generate(reqs)):
        assert c.token_ids == hf_greedy(p, n)
    assert len(steps) > 5


@pytest.mark.parametrize("stage", PAGED)
def test_decode_gathers_into_one_reused_buffer(tiny, stage):
    engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=4, block_size=4)
    pool = engine.pool
    gather = pool.gather_blocks
    storages = set()

    def spy(layer_idx, blocks):
        k, v = gather(layer_idx, blocks)
        storages.add(k.untyped_storage().data_ptr())
        assert v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        return k, v

    pool.gather_blocks = spy
    rng = random.Random(12)
    reqs = [Request(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(n)],
                    params=SamplingParams(max_new_tokens=24, stop_on_eos=False)) for n in (5, 17, 30, 2)]
    engine.generate(reqs)
    # The buffer grows (by half again) as contexts grow, a handful of times at most: never per step or
    # layer. From stage 10 on, the prefill reads prompts' blocks through it too: a growth or two more.
    assert 1 <= len(storages) <= (4 if int(stage[1:3]) < 10 else 6)


@pytest.mark.parametrize("stage", PAGED)
def test_fresh_blocks_are_zeroed_so_masked_garbage_cannot_poison_attention(tiny, hf_greedy, stage):
    engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=2, block_size=8, num_kv_blocks=16)
    for t in engine.pool.k + engine.pool.v:
        t.fill_(float("nan"))  # what uninitialised memory may hold
    engine.pool._fresh = [True] * engine.pool.allocator.num_blocks
    engine.pool.zero_if_fresh([0])
    prompts = [[101, 202, 303], [404] * 11]
    reqs = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=6, stop_on_eos=False)) for p in prompts]
    for p, c in zip(prompts, engine.generate(reqs)):
        assert c.token_ids == hf_greedy(p, 6)
    taken = [b for b, fresh in enumerate(engine.pool._fresh) if not fresh and b != 0]  # the blocks the requests took
    assert taken and not any(torch.isnan(t[:, taken]).any() for t in engine.pool.k + engine.pool.v)
