"""common.bench.metrics: every definition checked on synthetic timestamps with hand-computed values."""

from __future__ import annotations

import pytest

from common.bench.metrics import median_summary, percentiles, summarize
from common.requests import Completion

approx = pytest.approx


def completion(submitted: float | None, ts: list[float], prompt_len: int, **timings: float) -> Completion:
    if submitted is not None:
        timings["submitted"] = submitted
    return Completion(
        prompt_token_ids=list(range(prompt_len)),
        token_ids=list(range(len(ts))),
        text="",
        finish_reason="length",
        token_timestamps=ts,
        timings=timings,
    )


# Three requests (seconds):
#   A: submitted 0.00, tokens at 0.10 0.15 0.25 0.30, prompt 3
#   B: submitted 0.05, one token at 0.40,              prompt 5
#   C: submitted 0.10, tokens at 0.20 0.50,            prompt 2
RUN = [
    completion(0.00, [0.10, 0.15, 0.25, 0.30], 3),
    completion(0.05, [0.40], 5),
    completion(0.10, [0.20, 0.50], 2),
]


def test_percentiles_linear_interpolation() -> None:
    # sorted [10, 20, 30, 40]: rank = q * (n - 1) -> p50 at 1.5, p95 at 2.85, p99 at 2.97
    assert percentiles([40, 10, 30, 20]) == approx({"p50": 25.0, "p95": 38.5, "p99": 39.7})
    assert percentiles([]) == {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    assert percentiles([7.0]) == {"p50": 7.0, "p95": 7.0, "p99": 7.0}
    assert percentiles(iter([1.0, 2.0])) == approx({"p50": 1.5, "p95": 1.95, "p99": 1.99})


def test_counts_and_throughput() -> None:
    s = summarize(RUN)
    assert s["requests"] == 3
    assert s["prompt_tokens"] == 10
    assert s["completion_tokens"] == 7
    assert s["wall_s"] == approx(0.50)  # first submit 0.00 -> last token 0.50
    assert s["throughput_tok_s"] == approx({"completion": 7 / 0.5, "total": 17 / 0.5})


def test_ttft() -> None:
    # first token - submitted: A 100, B 350, C 100 -> sorted [100, 100, 350]
    assert summarize(RUN)["ttft_ms"] == approx({"p50": 100.0, "p95": 325.0, "p99": 345.0})


def test_tpot() -> None:
    # (last - first) / (n - 1): A 200/3, B 0 (one token), C 300 -> sorted [0, 66.67, 300]
    t = summarize(RUN)["tpot_ms"]
    a = 200 / 3
    assert t == approx({"p50": a, "p95": a + 0.9 * (300 - a), "p99": a + 0.98 * (300 - a)})


def test_single_token_requests_have_zero_tpot_and_no_itl() -> None:
    s = summarize([completion(0.0, [0.2], 4), completion(0.0, [0.3], 4)])
    assert s["tpot_ms"] == {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    assert s["itl_ms"] == {"p50": 0.0, "p95": 0.0, "p99": 0.0}


def test_itl_pools_every_gap() -> None:
    # gaps A 50, 100, 50; C 300 -> sorted [50, 50, 100, 300]: p50 at 1.5, p95 at 2.85, p99 at 2.97
    assert summarize(RUN)["itl_ms"] == approx({"p50": 75.0, "p95": 100 + 0.85 * 200, "p99": 100 + 0.97 * 200})


def test_latency() -> None:
    # last token - submitted: A 300, B 350, C 400
    assert summarize(RUN)["latency_ms"] == approx({"p50": 350.0, "p95": 395.0, "p99": 399.0})


def test_explicit_wall() -> None:
    s = summarize(RUN, wall_s=2.0)
    assert s["wall_s"] == 2.0
    assert s["throughput_tok_s"] == approx({"completion": 3.5, "total": 8.5})


def test_empty_and_missing_timings() -> None:
    s = summarize([])
    assert s["requests"] == 0 and s["wall_s"] == 0.0
    assert s["throughput_tok_s"] == {"completion": 0.0, "total": 0.0}
    assert s["ttft_ms"] == {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    # no "submitted": counts and ITL/TPOT still work, TTFT/latency have nothing to measure
    s = summarize([completion(None, [1.0, 1.5], 2)])
    assert s["completion_tokens"] == 2 and s["itl_ms"]["p50"] == approx(500.0)
    assert s["ttft_ms"]["p50"] == 0.0 and s["wall_s"] == 0.0


def test_streaming_fields_only_when_timed() -> None:
    assert not {"tokenize_ms", "queue_wait_ms", "prefill_to_first_token_ms"} & set(summarize(RUN))
    runs = [
        # submitted 1.000, tokenized 1.002, scheduled 1.010, first token 1.050
        completion(1.000, [1.050, 1.060], 4, tokenized=1.002, scheduled=1.010, first_token=1.050),
        # no "tokenized": queue wait counts from submit; first token from the timestamps
        completion(2.000, [2.100], 4, scheduled=2.030),
    ]
    s = summarize(runs)
    assert s["tokenize_ms"] == approx({"p50": 2.0, "p95": 2.0, "p99": 2.0})
    # queue wait: 8 and 30 -> p50 19, p95 8 + 0.95 * 22, p99 8 + 0.99 * 22
    assert s["queue_wait_ms"] == approx({"p50": 19.0, "p95": 28.9, "p99": 29.78})
    # prefill -> first token: 40 and 70
    assert s["prefill_to_first_token_ms"] == approx({"p50": 55.0, "p95": 68.5, "p99": 69.7})


def test_median_summary() -> None:
    runs = [summarize(RUN, wall_s=w) for w in (1.0, 2.0, 0.5)]
    runs[1]["ttft_ms"]["p99"] = 1000.0
    m = median_summary(runs)
    assert m["wall_s"] == 1.0
    assert m["throughput_tok_s"] == approx({"completion": 7.0, "total": 17.0})
    assert m["requests"] == 3 and isinstance(m["requests"], int)
    assert m["ttft_ms"] == approx({"p50": 100.0, "p95": 325.0, "p99": 345.0})
    assert m["spread"]["throughput_completion_tok_s"] == approx({"min": 3.5, "max": 14.0})
    assert m["spread"]["ttft_p99_ms"] == approx({"min": 345.0, "max": 1000.0})
    assert m["spread"]["ttft_p50_ms"] == approx({"min": 100.0, "max": 100.0})
    assert m["spread"]["tpot_p50_ms"] == approx({"min": 200 / 3, "max": 200 / 3})
    assert set(m) - {"spread"} == set(runs[0])  # same shape as one summary


def test_median_summary_even_count_and_single() -> None:
    runs = [{"completion_tokens": 10, "throughput_tok_s": {"completion": 1.0, "total": 2.0}},
            {"completion_tokens": 13, "throughput_tok_s": {"completion": 3.0, "total": 4.0}}]
    m = median_summary(runs)
    assert m["completion_tokens"] == 11.5 and m["throughput_tok_s"] == {"completion": 2.0, "total": 3.0}
    single = summarize(RUN)
    assert {k: v for k, v in median_summary([single]).items() if k != "spread"} == single
    with pytest.raises(ValueError, match="^summaries "):
        median_summary([])
