"""Stage 01's own idea: static batches, and a full-sequence forward for every new token.

Parity with transformers is covered for every stage in tests/test_parity.py; here we check
the *shape* of the work: batches run one after another, rows of a batch move in lockstep
(a finished row waits for the others but keeps only its own tokens), and each step feeds
the whole sequence so far to the model (no KV cache: T grows by one per step).
"""

from __future__ import annotations

import random

import torch

from common.requests import Request, SamplingParams
from conftest import run_hf_greedy, stage_module

# Loaded by name: no file of a stage may `import stages...` (tests/test_diff_discipline.py).
InferenceEngine = stage_module("s01_naive_batching").InferenceEngine


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


def test_static_batches_run_one_after_another(tiny):
    engine = InferenceEngine(tiny, max_batch_size=2)
    spy = engine.model = ForwardSpy(engine.model)
    max_new = [4, 2, 3, 5]
    comps = engine.generate(_requests(_prompts([3, 8, 5, 2]), max_new, stop_on_eos=False))
    assert [len(c.token_ids) for c in comps] == max_new
    assert [len(c.token_timestamps) for c in comps] == max_new
    first, second = comps[:2], comps[2:]
    end_of_first = max(c.token_timestamps[-1] for c in first)
    # The second batch starts only once the first one is completely done.
    for c in second:
        assert c.timings["scheduled"] >= end_of_first
        assert c.token_timestamps[0] > end_of_first
    # Rows of one batch share every step: same timestamps while both are alive.
    assert comps[1].token_timestamps == comps[0].token_timestamps[:2]
    assert comps[2].token_timestamps == comps[3].token_timestamps[:3]
    # Batch 1 runs max(4, 2) = 4 forwards over B=2 rows, batch 2 max(3, 5) = 5: the longest member sets the pace.
    assert [b for b, _ in spy.shapes] == [2] * 9
    assert [t for _, t in spy.shapes] == [8, 9, 10, 11, 5, 6, 7, 8, 9]
    assert all(c.timings["submitted"] == comps[0].timings["submitted"] for c in comps)


def test_each_step_recomputes_the_whole_sequence(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=4)
    spy = engine.model = ForwardSpy(engine.model)
    prompts = _prompts([4, 7], seed=1)
    comps = engine.generate(_requests(prompts, [5, 5], stop_on_eos=False))
    assert spy.shapes == [(2, 7 + i) for i in range(5)]  # T grows by one per step, from the longest prompt
    for i, pos in enumerate(spy.positions):
        assert pos[1].tolist() == list(range(7 + i))  # the longest row has no padding
        assert pos[0, -(4 + i):].tolist() == list(range(4 + i))  # left padding: real tokens start at 0
    for p, c in zip(prompts, comps):
        assert c.token_ids == hf_greedy(p, 5)


def test_finished_row_waits_but_keeps_only_its_own_tokens(tiny, hf_greedy):
    engine = InferenceEngine(tiny, max_batch_size=2)
    spy = engine.model = ForwardSpy(engine.model)
    short, long = _prompts([6, 3], seed=2)
    c_short, c_long = engine.generate(_requests([short, long], [2, 9]))
    assert c_short.token_ids == hf_greedy(short, 2) and c_short.finish_reason == "length"
    assert c_long.token_ids == hf_greedy(long, 9) and c_long.finish_reason == "length"
    # The short row stopped after step 2, but the batch still ran 9 forwards over both rows.
    assert spy.shapes == [(2, 6 + i) for i in range(9)]
    assert c_short.token_timestamps == c_long.token_timestamps[:2]
    assert c_short.timings["finished"] < c_long.timings["finished"]


def test_row_stopping_on_eos_keeps_its_eos_and_nothing_after(tiny, hf_tiny):
    short, long = _prompts([6, 3], seed=2)
    plain = run_hf_greedy(hf_tiny, short, 9, tiny.config.eos_token_ids)
    # Make the short row's 3rd greedy token the end-of-sequence token (first time it appears).
    k = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])
    eos = (plain[k],)
    engine = InferenceEngine(tiny, max_batch_size=2)
    engine.eos_token_ids = eos
    c_short, c_long = engine.generate(_requests([short, long], [9, 9]))
    assert c_short.token_ids == plain[: k + 1] and c_short.finish_reason == "stop"
    expected_long = run_hf_greedy(hf_tiny, long, 9, eos)
    assert c_long.token_ids == expected_long
    assert len(c_long.token_ids) > len(c_short.token_ids)  # rows really finished at different steps
    assert c_long.finish_reason == ("stop" if expected_long[-1] == eos[0] else "length")
    assert c_short.text == tiny.tokenizer.decode(c_short.token_ids, skip_special_tokens=True)


def test_no_kv_cache_is_kept(tiny):
    engine = InferenceEngine(tiny, max_batch_size=2)
    engine.generate(_requests(_prompts([5, 9, 2]), [3, 4, 2]))
    assert engine.kv_stats()["peak_kv_bytes"] == 0
