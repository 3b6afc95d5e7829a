"""Identical prompts in one burst are prefilled once (stage 06 on), and only identical ones.

Why: stages 06-07 key the prefix cache by the prompt's text, as post 004 does, and the cache
checks that a text hit also has the same token ids (a caller may send its own tokenization beside
the text). The in-batch dedup must check the same: two requests with the same text and different
ids shared the first one's K/V and logits, and the second decoded the first's continuation.
"""
from __future__ import annotations

import importlib

import pytest

from common import stages as registry
from common.requests import SamplingParams
from conftest import burst_packages

BURSTS = burst_packages()


@pytest.mark.parametrize("package", BURSTS, ids=registry.short_name)
def test_the_same_text_with_other_token_ids_is_no_duplicate(package, tiny, hf_greedy, one_torch_thread) -> None:
    stage = registry.load_stage(package)
    request = importlib.import_module(f"{package}.scheduler").OnlineRequest
    sched = stage.OnlineScheduler(stage.InferenceEngine(tiny, max_batch_size=4, block_size=4), max_batch_size=4)
    ids = [[101, 202, 303], [404, 505, 606, 707], [101, 202, 303]]  # the first and last are duplicates
    params = SamplingParams(max_new_tokens=5, stop_on_eos=False)
    rids = sched.add_requests([request(prompt="same text", prompt_token_ids=i, params=params) for i in ids])
    assert all(isinstance(r, int) for r in rids), rids
    out = {}
    while sched.has_unfinished():
        sched.step()
        for rid in sched.pop_finished_ids():
            out[rid] = sched.pop_completion(rid).token_ids
    assert [out[r] for r in rids] == [hf_greedy(i, 5) for i in ids]
