"""common.sampling: HF semantics, per-request seeds, filters that never leak, batched == per row."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.requests import SamplingParams
from common.sampling import PICK_CHUNK, _filter_top_k_top_p, greedy_pick, make_generator, sample_tokens


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(do_sample=True, **kw)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n draws from one row of logits, batched into one call (global RNG)."""
    return sample_tokens(logits.expand(n, -1).clone(), [params] * n)


def test_make_generator() -> None:
    assert make_generator(SamplingParams()) is None
    a, b = make_generator(SamplingParams(seed=3), "cpu"), make_generator(SamplingParams(seed=3), "cpu")
    assert a is not None and b is not None
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    greedy = [SamplingParams(), SamplingParams(do_sample=True, temperature=0.0)] * 2
    assert sample_tokens(logits, greedy) == torch.argmax(logits, dim=-1).tolist()
    tie = torch.tensor([[1.0, 5.0, 5.0, 0.0]])
    assert sample_tokens(tie, [SamplingParams()]) == [1]  # first maximum, like torch.argmax
    half = torch.randn(3, 50).to(torch.bfloat16)
    assert sample_tokens(half, [SamplingParams()] * 3) == torch.argmax(half.float(), dim=-1).tolist()


@pytest.mark.parametrize("vocab", [PICK_CHUNK - 1, 2 * PICK_CHUNK, 49152, 50257])
def test_greedy_pick_is_argmax_with_ties_and_nan(vocab: int) -> None:
    """The chunked pick gives argmax's index on every row: ties across chunks, inside a chunk,
    between a chunk and the tail (the earlier wins), a maximum in the tail, NaN (sorts above)."""
    torch.manual_seed(0)
    scores = torch.randn(12, vocab)
    scores[0, [3, vocab - 1]] = 9.0  # a tie between the first chunk and the last entry
    c = min(PICK_CHUNK, vocab // 2)
    scores[1, [c + 5, c + 7]] = 9.0  # a tie inside one chunk
    scores[2, vocab - 1] = 9.0  # the maximum is the last entry (in the tail when there is one)
    scores[3, [vocab // 2, vocab - 2]] = 9.0  # a tie between a middle chunk and the tail
    scores[4, vocab - 3] = float("nan")
    scores[5, [7, vocab - 1]] = float("nan")
    scores[6] = 0.0  # every entry equal
    scores[7, [1, vocab // 2]] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        x = scores.to(dtype)
        assert greedy_pick(x).tolist() == torch.argmax(x, dim=-1).tolist(), dtype


def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)  # flat-ish: many plausible tokens

    def run(seed: int) -> list[int]:
        params = _sampled(seed=seed, temperature=1.5)
        gen = make_generator(params)
        return [sample_tokens(logits, [params], [gen])[0] for _ in range(30)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_unseeded_rows_use_the_global_rng() -> None:
    logits = torch.randn(1, 500)
    torch.manual_seed(7)
    a = _draw(logits, _sampled(), 20)
    torch.manual_seed(7)
    assert _draw(logits, _sampled(), 20) == a


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_emits_outside_the_k_largest(k: int) -> None:
    torch.manual_seed(k)
    logits = torch.randn(1, 64) * 0.5  # flat, so the excluded tokens would often be drawn
    allowed = set(torch.topk(logits[0], k).indices.tolist())
    drawn = _draw(logits, _sampled(top_k=k, temperature=2.0), 2000)
    assert set(drawn) == allowed  # within the set, and every member reachable


def test_top_k_larger_than_vocab_is_off() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(1, 8)
    assert set(_draw(logits, _sampled(top_k=100), 1000)) == set(range(8))


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.75, {0, 1}), (0.85, {0, 1, 2}), (0.01, {0}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_never_emits_outside_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    # probabilities 0.5, 0.3, 0.1, 0.05, 0.05: cumulative from the bottom 0.05, 0.1, 0.2, 0.5, 1.0,
    # so HF removes the tail with cumulative mass <= 1 - top_p (and always keeps the top token).
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]])
    torch.manual_seed(0)
    drawn = _draw(probs.log(), _sampled(top_p=top_p), 3000)
    assert set(drawn) == nucleus
    # frequencies follow the renormalised nucleus probabilities
    mass = sum(probs[0, i].item() for i in nucleus)
    for i in nucleus:
        assert abs(drawn.count(i) / len(drawn) - probs[0, i].item() / mass) < 0.04


def test_top_k_then_top_p_and_temperature_order() -> None:
    # temperature first: T=0.5 squares the probabilities (0.5,0.3,0.1,.05,.05 -> ~.71,.26,.03,...),
    # top-k=3 then keeps {0,1,2}; top_p=0.9 keeps {0,1} (tail 0.03 <= 0.1 removed).
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]])
    torch.manual_seed(1)
    assert set(_draw(probs.log(), _sampled(temperature=0.5, top_k=3, top_p=0.9), 2000)) == {0, 1}


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.05])
def test_filter_matches_hf_warpers(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 200) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    cand, cand_idx, num_removed = _filter_top_k_top_p(logits / temperature, [top_k or 200] * 3, [top_p] * 3)
    kept = torch.full_like(logits, float("-inf"))
    for row in range(3):
        start = int(num_removed[row])  # what was removed is a prefix of the ascending candidates
        assert torch.isinf(cand[row, :start]).all() and not torch.isinf(cand[row, start:]).any()
        kept[row, cand_idx[row, start:]] = cand[row, start:]
    assert torch.equal(torch.isinf(kept), torch.isinf(expected))
    assert torch.allclose(kept, expected)


def test_rows_with_different_filters_match_hf_row_by_row() -> None:
    torch.manual_seed(1)
    top_k, top_p = [3, 40, 200, 1, 7], [0.9, 1.0, 0.6, 0.5, 0.99]
    logits = torch.randn(5, 200) * 2
    cand, cand_idx, num_removed = _filter_top_k_top_p(logits, top_k, top_p)
    for row in range(5):
        expected = TopKLogitsWarper(top_k[row])(None, logits[row : row + 1].clone())
        if top_p[row] < 1:
            expected = TopPLogitsWarper(top_p[row])(None, expected)
        start = int(num_removed[row])
        survivors = torch.nonzero(~torch.isinf(expected[0])).flatten()
        assert set(cand_idx[row, start:].tolist()) == set(survivors.tolist())


def test_top_k_keeps_ties_like_hf() -> None:
    # the 2nd largest value (2.0) is shared by three tokens: HF keeps all of them
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    expected = TopKLogitsWarper(2)(None, logits.clone())
    assert torch.isinf(expected).tolist() == [[False, False, False, False, True, True]]
    torch.manual_seed(0)
    assert set(_draw(logits, _sampled(top_k=2, temperature=3.0), 1000)) == {0, 1, 2, 3}
    # ties inside the candidates (no spill past k): still exactly the k best
    logits = torch.tensor([[3.0, 3.0, 2.0, 1.0, 0.0]])
    assert set(_draw(logits, _sampled(top_k=2, temperature=3.0), 1000)) == {0, 1}


def test_batched_mixed_rows_match_per_row_calls() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(),
        _sampled(seed=1, temperature=0.7, top_k=5),
        SamplingParams(do_sample=True, temperature=0.0, seed=9),
        _sampled(seed=2, top_p=0.9),
        _sampled(seed=3, temperature=1.3, top_k=20, top_p=0.5),
        _sampled(seed=4, temperature=2.0),
        SamplingParams(top_k=3),  # do_sample=False: filters are ignored, greedy
    ]
    logits = torch.randn(len(params), 300) * 2
    for _ in range(5):
        batch_gens = [make_generator(p) for p in params]
        row_gens = [make_generator(p) for p in params]
        for _step in range(4):  # generators advance identically over several steps
            batched = sample_tokens(logits, params, batch_gens)
            single = [
                sample_tokens(logits[i : i + 1], [p], [g])[0] for i, (p, g) in enumerate(zip(params, row_gens))
            ]
            assert batched == single
        logits = torch.randn_like(logits) * 2


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="^logits "):
        sample_tokens(torch.zeros(5), [SamplingParams()])
    with pytest.raises(ValueError, match="^params "):
        sample_tokens(torch.zeros(2, 5), [SamplingParams()])
    with pytest.raises(ValueError, match="^generators "):
        sample_tokens(torch.zeros(2, 5), [SamplingParams()] * 2, [None])


def test_returns_python_ints() -> None:
    params = [SamplingParams(), _sampled(seed=0)]
    out = sample_tokens(torch.randn(2, 10), params, [make_generator(p) for p in params])
    assert all(type(t) is int and 0 <= t < 10 for t in out)
