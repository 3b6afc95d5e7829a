"""bf16, CUDA's default dtype, run on the CPU: a dtype slip is caught in CI, which has no GPU.

On a GPU every stage runs in bf16 unless told otherwise (`resolve_dtype`), while every other test
runs `tiny` in fp32 so that tokens can be compared exactly. A tensor made in the wrong dtype (a KV
pool or a mask in fp32 beside bf16 activations, say) either raises inside SDPA or silently costs
twice the KV memory; the CPU takes the same code paths in bf16, so both show here.

What bf16 cannot give is exact parity: transformers' bf16 `generate` rounds the same ops in the
same order only where the shapes are the same, and a stage batches, pads and chunks. Which way a
near tie between the two best tokens tips then depends on the machine's kernels too: on `tiny`,
12 prompts, 3 seeds, torch 2.13, the share of tokens before each row's first difference was
0.94-1.0 with ATen's AVX2 kernels, 0.85-0.98 with its AVX-512 ones and 1.0 with the scalar ones
(`ATEN_CPU_CAPABILITY`), on the same CPU. So the check is the one `stagewise parity` reports
(common/bench/parity.py): wherever a row first differs from transformers', transformers' own best two
logits there were within a few bf16 steps of each other, a tie that rounding may break either way.
A real error (a wrong mask, position or cache entry) flips tokens where the model was sure: the
median margin of `tiny`'s greedy tokens is about 12 steps, and every difference measured with
the AVX2 and AVX-512 kernels above (4 seeds) was within 1.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.bench.parity import first_difference, reference_top2
from common.requests import Request, SamplingParams
from conftest import STAGE_DIRS, run_hf_greedy, stage_module, streaming_packages

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # batches of four tiny rows
MAX_NEW = 16
MAX_TIE_STEPS = 4  # a first difference must sit where transformers' top two logits are this close, in bf16 steps


@pytest.fixture(scope="module")
def tiny_bf16():
    from common.loader import load_model

    return load_model("tiny", device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_bf16):
    """12 random token prompts of 1-90 tokens, and transformers' bf16 greedy tokens for each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_bf16.path, dtype=torch.bfloat16).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 90))] for _ in range(12)]
    return prompts, [run_hf_greedy(hf, p, MAX_NEW, tiny_bf16.config.eos_token_ids) for p in prompts], hf


def bf16_steps(margin: float, top: float) -> float:
    """`margin` in units of bf16's spacing at the size of `top` (8 significant bits: 0.125 from 16 to 32)."""
    return margin / 2.0 ** (math.floor(math.log2(abs(top))) - 7)


def _not_ties(outputs: list[list[int]], prompts: list[list[int]], reference: list[list[int]], hf) -> list[dict]:
    """The rows whose first difference from the reference is more than rounding: [] when all agree up to ties."""
    bad = []
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        at = first_difference(out, ref)
        if at is None:
            continue
        if at >= len(ref) or at >= len(out):  # one stopped (EOS) where the other went on: that is a token too
            bad.append({"row": i, "at": at, "why": "lengths differ"})
            continue
        best, second = reference_top2(hf, prompts[i], ref, at)
        steps = bf16_steps(best - second, best)
        if steps > MAX_TIE_STEPS:
            bad.append({"row": i, "at": at, "ours": out[at], "reference": ref[at], "bf16_steps": steps})
    return bad


def _check_kv_dtype(engine, config, batches: list[list[list[int]]]) -> None:
    """The KV memory the engine reports is bf16's: 2 bytes a value, not fp32's 4."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    stats = engine.kv_stats()
    if "pool_kv_bytes" in stats:  # stage 03 on: one pool of blocks
        assert stats["pool_kv_bytes"] == stats["num_blocks"] * stats["block_size"] * per_token
    elif engine.__module__.startswith("stages.s01_"):  # no KV cache: it recomputes every step
        assert stats["peak_kv_bytes"] == 0
    else:  # stage 02: a rectangle per static batch, the largest batch's kept
        biggest = max(len(b) * (max(map(len, b)) + MAX_NEW) for b in batches)
        assert stats["peak_kv_bytes"] == biggest * per_token


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_offline_generate_in_bf16_agrees_with_transformers_bf16(stage, tiny_bf16, prompts_and_reference):
    prompts, reference, hf = prompts_and_reference
    engine = stage_module(stage).InferenceEngine(tiny_bf16, max_batch_size=4)
    completions = engine.generate([Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=MAX_NEW))
                                   for p in prompts])
    outputs = [c.token_ids for c in completions]
    assert _not_ties(outputs, prompts, reference, hf) == [], stage
    _check_kv_dtype(engine, tiny_bf16.config, [prompts[i:i + 4] for i in range(0, len(prompts), 4)])


@pytest.mark.parametrize("stage", [s for s in STAGE_DIRS if s >= "s03"])  # the paged stages' DecodeAttention
def test_written_out_decode_attention_in_bf16_agrees_with_transformers_bf16(stage, tiny_bf16, prompts_and_reference,
                                                                            monkeypatch):
    """`decode_attention` writes bf16 attention out only over large K/V rectangles, which `tiny`'s
    batches of four never reach: with its threshold at 0 every decode step takes that path."""
    from torch.profiler import ProfilerActivity, profile

    from common import model

    monkeypatch.setattr(model, "DECODE_MATMUL_MIN_KEYS", 0)
    prompts, reference, hf = prompts_and_reference
    engine = stage_module(stage).InferenceEngine(tiny_bf16, max_batch_size=4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        completions = engine.generate([Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=MAX_NEW))
                                       for p in prompts])
    assert "aten::bmm" in {e.key for e in prof.key_averages()}, "no decode step took the written-out path"
    assert _not_ties([c.token_ids for c in completions], prompts, reference, hf) == [], stage


@pytest.mark.parametrize("package", streaming_packages())
def test_streaming_in_bf16_through_the_scheduler_manager(package, tiny_bf16, prompts_and_reference):
    """The server's path: the worker thread, streamed chunks, seeded sampling, all in bf16."""
    from common import stages as registry

    stage = registry.load_stage(package)
    prompts, reference, hf = prompts_and_reference
    manager = stage.SchedulerManager(stage.InferenceEngine(tiny_bf16, max_batch_size=4), max_batch_size=4)
    try:
        greedy = [manager.add_request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=MAX_NEW))
                  for p in prompts]
        sampled = [manager.add_request(prompt_token_ids=p, params=SamplingParams(
            max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=7, stop_on_eos=False))
            for p in prompts[:4]]
        outputs = []
        for handle in greedy + sampled:
            chunks = list(handle)  # ends when the request does; raises the request's error if it failed
            completion = handle.result(timeout=60)
            assert [t for c in chunks for t in c.token_ids] == completion.token_ids
            assert "".join(c.text for c in chunks) == completion.text
            outputs.append(completion.token_ids)
    finally:
        manager.close()
    greedy_out, sampled_out = outputs[:len(prompts)], outputs[len(prompts):]
    assert _not_ties(greedy_out, prompts, reference, hf) == [], package
    assert all(len(out) == MAX_NEW for out in sampled_out)
