"""The batched prefill of every stage that has one (06 on): each prompt of a burst gets the
logits transformers gives it alone.

Stages 06-09 pad a burst to `[N, T]` on the right and attend with the causal mask alone (no
padding mask: right padding never lies before a real token); stage 10 packs the burst into one
row, where a prompt with nothing cached attends causally over its own new K/V and one with a
cached prefix reads its blocks through a mask; stage 11 prefills a prompt longer than its token
budget in chunks, each attending over the K/V the earlier ones wrote. Greedy parity
(tests/test_parity.py) would miss a slip that moves a logit without changing the argmax on the
tiny model, so this compares the logits themselves, for prompts of very different lengths in one
forward (or chunked), then for a burst that mixes a cached prefix with a fresh prompt.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams, prepare_prompt
from conftest import STAGE_DIRS, stage_module

BATCHED = [s for s in STAGE_DIRS if hasattr(stage_module(s).InferenceEngine, "prefill_sessions")]
# Stage 11 on: a step is one forward under a token budget, and a prompt longer than it is prefilled in chunks.
CHUNKED = [s for s in STAGE_DIRS if hasattr(stage_module(s).InferenceEngine, "step_sessions")]
ATOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _prefill(engine, prompts: list[list[int]]) -> torch.Tensor:
    """One `prefill_sessions` call for the whole burst: last logits [N, V]."""
    sessions = []
    for p in prompts:
        request = Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=1))
        session = engine.new_session(request, prepare_prompt(request, engine.tokenizer, engine.max_model_len))
        engine.reserve(session)
        sessions.append(session)
    return engine.prefill_sessions(sessions)


def test_the_batched_stages_are_found():
    assert [s[:3] for s in BATCHED] == ["s06", "s07", "s08", "s09", "s10"]


@pytest.mark.parametrize("stage", BATCHED)
def test_every_prompt_of_a_burst_gets_its_own_logits(tiny, hf_tiny, stage):
    engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=8, block_size=4)
    long = _ids(33, seed=3)
    bursts = [
        [_ids(n, seed=n) for n in (17, 1, 6)] + [long],  # very different lengths: lots of padding in 06-09
        [long + _ids(5, seed=5), _ids(9, seed=9)],  # stage 10: 32 of the first prompt's tokens are cached, the second is fresh
    ]
    with torch.inference_mode():
        for burst in bursts:
            logits = _prefill(engine, burst)  # [N, V]
            for prompt, row in zip(burst, logits):
                expected = hf_tiny(torch.tensor([prompt], device=hf_tiny.device)).logits[0, -1]
                torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
    if hasattr(engine.prefix_cache, "match"):  # stage 10's block cache: the second burst did read a cached prefix
        assert engine.prefix_cache.hits == 1


def _chunked_prefill(engine, prompts: list[list[int]]) -> tuple[torch.Tensor, int]:
    """The burst through `step_sessions` (no decode rows) until every prompt has its K/V: its
    prompts' last logits [N, V] in prompt order, and how many forwards that took."""
    sessions = []
    for p in prompts:
        request = Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=1))
        session = engine.new_session(request, prepare_prompt(request, engine.tokenizer, engine.max_model_len))
        engine.reserve(session)
        sessions.append(session)
    rows: dict[int, torch.Tensor] = {}
    forwards = 0
    while len(rows) < len(sessions):
        logits, done = engine.step_sessions([], [s for s in sessions if id(s) not in rows])
        forwards += 1
        assert len(done) == logits.shape[0]  # one row per prompt finished in this step, in its order
        rows.update((id(s), row) for s, row in zip(done, logits))
    return torch.stack([rows[id(s)] for s in sessions]), forwards


def test_the_chunked_stages_are_found():
    assert CHUNKED and CHUNKED[0][:3] == "s11"


@pytest.mark.parametrize("stage", CHUNKED)
def test_a_prompt_prefilled_in_chunks_gets_the_logits_of_the_whole(tiny, hf_tiny, stage):
    """A budget of 7 tokens a step splits every prompt longer than it into chunks (at any offset
    in a block of 4): each prompt's last logits equal transformers' and the unchunked run's."""
    module = stage_module(stage)
    long = _ids(33, seed=3)
    bursts = [  # (prompts, forwards at 7 tokens each)
        ([_ids(n, seed=n) for n in (17, 1, 6)] + [long], 9),  # 57 tokens
        ([long + _ids(5, seed=5), _ids(9, seed=9)], 3),  # 32 of the first prompt's 38 tokens are cached: 6 + 9 computed
    ]
    chunked = module.InferenceEngine(tiny, max_batch_size=4, block_size=4, max_num_batched_tokens=7)
    whole = module.InferenceEngine(tiny, max_batch_size=4, block_size=4, max_num_batched_tokens=4096)
    with torch.inference_mode():
        for burst, steps in bursts:
            logits, forwards = _chunked_prefill(chunked, burst)  # [N, V]
            assert forwards == steps  # the budget did split the burst
            unchunked, one = _chunked_prefill(whole, burst)  # a budget that holds the burst
            assert one == 1
            for prompt, row, ref in zip(burst, logits, unchunked):
                expected = hf_tiny(torch.tensor([prompt], device=hf_tiny.device)).logits[0, -1]
                torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
                torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
    assert chunked.prefix_cache.hits == 1  # the second burst did read a cached prefix
