"""Every stage hands SDPA its masks as additive float masks, built once per forward
(`common.model.additive_mask`). Given a boolean mask, SDPA converts it in every call, so in every
layer: two `where`s and their scalar tensors, 48 kernel launches a decode step of GPT-2's 12
layers on the H200's profile, for a mask that is the same in all of them. The tokens are checked
by the parity tests; this checks that the conversion is gone and that it changes no output bit.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from common.model import additive_mask
from common.requests import Request, SamplingParams
from conftest import STAGE_DIRS, stage_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_gives_sdpa_the_same_bits_as_the_boolean_one(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 8, n, 64, generator=g).to(dtype) for n in (3, 40, 40))  # [Hkv, B, G or L, D]
    allowed = (torch.arange(40) < torch.randint(1, 41, (8,), generator=g)[:, None])[None, :, None, :]
    mask = additive_mask(allowed, dtype)
    assert mask.dtype == dtype and set(mask.unique().tolist()) <= {0.0, float("-inf")}
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_no_stage_makes_sdpa_convert_a_mask(tiny, stage: str) -> None:
    engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=3)
    rng = random.Random(3)
    reqs = [Request(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(n)],
                    params=SamplingParams(max_new_tokens=4, stop_on_eos=False)) for n in (5, 11, 2)]
    engine.generate(reqs)  # warm: the profiled run below is prefill and decode, as every run is
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tiny.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate([Request(prompt_token_ids=r.prompt_token_ids, params=r.params) for r in reqs])
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("aten::scaled_dot_product_attention", 0) > 0
    assert "aten::where" not in ops, f"{ops['aten::where']} boolean masks converted inside SDPA"
