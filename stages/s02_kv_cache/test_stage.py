"""Stage 02's own idea: prefill once into a contiguous per-batch KV cache, then one token per step.

Parity with transformers for every stage lives in tests/test_parity.py; here we check that
the model really sees the prompt once and then a single token per row per step (at the
right positions), that the cache is sized for the batch's worst case, and that a batch
whose rows stop on EOS at different steps still decodes exactly what transformers does.
"""

from __future__ import annotations

import random

import torch

from common.requests import Request, SamplingParams
from conftest import run_hf_greedy, stage_module

# Loaded by name: no file of a stage may `import stages...` (tests/test_diff_discipline.py).
InferenceEngine = stage_module("s02_kv_cache").InferenceEngine


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _requests(prompts: list[list[int]], max_new: list[int], stop_on_eos: bool = True) -> list[Request]:
    return [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=n, stop_on_eos=stop_on_eos))
            for p, n in zip(prompts, max_new)]


class ForwardSpy:
    """Stands in for engine.model: records the shape and positions of every forward call."""

    def __init__(self, model) -> None:
        self.model = model
        self.shapes: list[tuple[int, int]] = []
        self.positions: list[torch.Tensor] = []

    def __call__(self, input_ids, positions, attention, logits_indices=None):
        self.shapes.append(tuple(input_ids.shape))
        self.positions.append(positions.clone())
        return self.model(input_ids, positions, attention, logits_indices=logits_indices)


def _kv_bytes(config, batch: int, capacity: int) -> int:
    return 2 * config.num_layers * batch * config.num_kv_heads * capacity * config.head_dim * 4  # fp32


def test_prefill_once_then_one_token_per_step(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4)
    spy = engine.model = ForwardSpy(engine.model)
    prompts = _prompts([5, 11, 3], seed=3)
    max_new = [2, 7, 4]
    comps = engine.generate(_requests(prompts, max_new, stop_on_eos=False))
    assert [len(c.token_ids) for c in comps] == max_new
    # One prefill over the longest prompt, then one decode call per further token of the longest row.
    assert len(spy.shapes) == max(len(c.token_ids) for c in comps) == 7
    assert spy.shapes[0] == (3, 11)
    assert spy.shapes[1:] == [(3, 1)] * 6
    # Decode step i feeds each row's newest token at position len(prompt) + i - 1 (while the row is alive).
    for i, pos in enumerate(spy.positions[1:], start=1):
        for b, (p, n) in enumerate(zip(prompts, max_new)):
            if i < n:
                assert pos[b, 0].item() == len(p) + i - 1
    for p, n, c in zip(prompts, max_new, comps):
        assert c.token_ids == hf_greedy(p, n)


def test_each_batch_gets_its_own_prefill(tiny):
    engine = InferenceEngine(tiny, max_batch_size=2)
    spy = engine.model = ForwardSpy(engine.model)
    engine.generate(_requests(_prompts([5, 11, 3, 4], seed=4), [2, 3, 4, 1], stop_on_eos=False))
    assert spy.shapes == [(2, 11), (2, 1), (2, 1), (2, 4), (2, 1), (2, 1), (2, 1)]


def test_cache_is_sized_for_the_batch_worst_case(tiny):
    cfg = tiny.config
    engine = InferenceEngine(tiny, max_batch_size=3)
    engine.generate(_requests(_prompts([5, 11, 3], seed=5), [2, 7, 4]))
    # Every row pays for the longest prompt (11) plus the most new tokens anyone asked for (7).
    assert engine.kv_stats()["peak_kv_bytes"] == _kv_bytes(cfg, 3, 11 + 7)


def test_peak_is_the_largest_batch_not_the_sum(tiny):
    cfg = tiny.config
    engine = InferenceEngine(tiny, max_batch_size=2)
    # Batch 1: prompts 5 and 11, up to 7 new -> [2, 18]; batch 2: prompts 3 and 4, up to 4 new -> [2, 8].
    engine.generate(_requests(_prompts([5, 11, 3, 4], seed=6), [2, 7, 4, 3]))
    assert engine.kv_stats()["peak_kv_bytes"] == _kv_bytes(cfg, 2, 18)
    # A later, smaller run does not lower the peak; a larger one raises it.
    engine.generate(_requests(_prompts([2], seed=7), [2]))
    assert engine.kv_stats()["peak_kv_bytes"] == _kv_bytes(cfg, 2, 18)
    engine.generate(_requests(_prompts([20, 1], seed=8), [10, 1]))
    assert engine.kv_stats()["peak_kv_bytes"] == _kv_bytes(cfg, 2, 30)


def test_rows_stopping_on_eos_at_different_steps_match_transformers(tiny, hf_tiny):
    prompts = _prompts([9, 2, 17, 5], seed=9)
    plain = run_hf_greedy(hf_tiny, prompts[0], 12, tiny.config.eos_token_ids)
    # Force an early EOS: row 0's 3rd greedy token (its first occurrence) ends a sequence.
    k = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])
    eos = (plain[k],)
    engine = InferenceEngine(tiny, max_batch_size=4)
    engine.eos_token_ids = eos
    spy = engine.model = ForwardSpy(engine.model)
    comps = engine.generate(_requests(prompts, [12] * 4))
    expected = [run_hf_greedy(hf_tiny, p, 12, eos) for p in prompts]
    assert [c.token_ids for c in comps] == expected
    assert comps[0].token_ids == plain[: k + 1] and comps[0].finish_reason == "stop"
    for c, e in zip(comps, expected):
        assert c.finish_reason == ("stop" if e[-1] == eos[0] else "length")
        assert c.text == tiny.tokenizer.decode(e, skip_special_tokens=True)
    lengths = [len(c.token_ids) for c in comps]
    assert min(lengths) < 12 and max(lengths) == 12, lengths  # rows finished at different steps
    assert len(spy.shapes) == 12  # the batch runs until its longest member is done
