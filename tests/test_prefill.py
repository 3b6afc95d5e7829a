"""The batched prefill of every stage that has one (06 on): each prompt of a burst gets the
logits transformers gives it alone.

Stages 06-09 pad a burst to `[N, T]` on the right and attend with the causal mask alone (no
padding mask: right padding never lies before a real token); stage 10 packs the burst into one
row, where a prompt with nothing cached attends causally over its own new K/V and one with a
cached prefix reads its blocks through a mask. Greedy parity (tests/test_parity.py) would miss
a slip that moves a logit without changing the argmax on the tiny model, so this compares the
logits themselves, for prompts of very different lengths in one forward, then for a burst that
mixes a cached prefix with a fresh prompt.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.requests import Request, SamplingParams, prepare_prompt
from conftest import STAGE_DIRS, stage_module

BATCHED = [s for s in STAGE_DIRS if hasattr(stage_module(s).InferenceEngine, "prefill_sessions")]
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
