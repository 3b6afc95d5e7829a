"""Latency and throughput metrics, defined exactly as in the source posts (000 and 002).

Per request, with `ts` = its token timestamps and `submitted` = `timings["submitted"]`:

* TTFT    = ts[0] - submitted                    (queueing + prefill + first sample)
* TPOT    = (ts[-1] - ts[0]) / (n - 1)            (0 when n == 1, as the posts print 0.00)
* ITL     = every ts[i] - ts[i-1], pooled over all requests (the distribution of gaps)
* decode step = ITL p50: the median gap, i.e. the time one decode step takes as a client sees it
  (compared with the matmul floor of common/bench/floor.py)
* latency = ts[-1] - submitted
* throughput = completion tokens / wall and (prompt + completion) tokens / wall, with
  wall = first submit -> last token unless the caller measured it.

All times are `time.perf_counter()` seconds in, milliseconds out (suffix `_ms`); distributions are
reported as p50/p95/p99 with numpy's linear interpolation. Only numpy is imported so that the
metrics stay cheap to use from scripts.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from common.requests import Completion

_ZERO = {"p50": 0.0, "p95": 0.0, "p99": 0.0}


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """{"p50", "p95", "p99"} of `values` (numpy linear interpolation); all 0.0 when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return dict(_ZERO)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99], method="linear")
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def _ms(values: list[float]) -> dict[str, float]:
    return percentiles(v * 1000.0 for v in values)


def summarize(completions: Sequence[Completion], wall_s: float | None = None) -> dict[str, Any]:
    """The bench JSON's metric fields for one run of `completions`.

    Requests without token timestamps count for tokens but not for timing distributions; those
    without `timings["submitted"]` are left out of TTFT and latency. The streaming fields
    (tokenize_ms, queue_wait_ms, prefill_to_first_token_ms) appear only when some completion has
    the timings they need (the streaming engines of stage 04+ fill them).
    """
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    latency: list[float] = []
    tokenize: list[float] = []
    queue_wait: list[float] = []
    prefill_to_first: list[float] = []
    starts: list[float] = []
    ends: list[float] = []

    for c in completions:
        ts = c.token_timestamps
        t = c.timings
        submitted = t.get("submitted")
        if submitted is not None:
            starts.append(submitted)
        if ts:
            ends.append(ts[-1])
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0)
            itl.extend(b - a for a, b in zip(ts, ts[1:]))
            if submitted is not None:
                ttft.append(ts[0] - submitted)
                latency.append(ts[-1] - submitted)
        if submitted is not None and "tokenized" in t:
            tokenize.append(t["tokenized"] - submitted)
        if "scheduled" in t:
            ready = t.get("tokenized", submitted)
            if ready is not None:
                queue_wait.append(t["scheduled"] - ready)
            first = t.get("first_token", ts[0] if ts else None)
            if first is not None:
                prefill_to_first.append(first - t["scheduled"])

    prompt_tokens = sum(len(c.prompt_token_ids) for c in completions)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    if wall_s is None:
        wall_s = max(ends) - min(starts) if starts and ends else 0.0
    wall_s = float(wall_s)
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0

    out: dict[str, Any] = {
        "requests": len(completions),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "wall_s": wall_s,
        "throughput_tok_s": {
            "completion": completion_tokens * per_s,
            "total": (prompt_tokens + completion_tokens) * per_s,
        },
        "ttft_ms": _ms(ttft),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms(itl),
        "latency_ms": _ms(latency),
    }
    out["decode_step_ms"] = out["itl_ms"]["p50"]
    per_step = list(Counter(t for c in completions for t in c.token_timestamps).values())
    if per_step:  # an engine stamps every token of one step with the same time: tokens per step
        out["step_batch"] = {"mean": sum(per_step) / len(per_step), "peak": max(per_step)}
    for key, values in (
        ("tokenize_ms", tokenize),
        ("queue_wait_ms", queue_wait),
        ("prefill_to_first_token_ms", prefill_to_first),
    ):
        if values:
            out[key] = _ms(values)
    return out


# The numbers whose run-to-run spread a benchmark reports next to the medians.
_HEADLINE: dict[str, tuple[str, str]] = {
    "throughput_completion_tok_s": ("throughput_tok_s", "completion"),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "tpot_p50_ms": ("tpot_ms", "p50"),
}


def _median(values: list[Any]) -> Any:
    """Element-wise median of same-shaped values: numbers, or dicts of them (recursively)."""
    first = values[0]
    if isinstance(first, dict):
        keys = list(first) + [k for v in values[1:] if isinstance(v, dict) for k in v if k not in first]
        merged: dict[str, Any] = {}
        for k in dict.fromkeys(keys):
            present = [v[k] for v in values if isinstance(v, dict) and k in v]
            merged[k] = _median(present)
        return merged
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) != len(values):
        return first  # strings, lists, bools: not averaged, the first run's value stands
    med = statistics.median(nums)
    if all(isinstance(v, int) for v in nums) and float(med).is_integer():
        return int(med)
    return float(med)


def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeat runs of `summarize()` outputs, same shape, plus `spread`.

    Benchmarks repeat a run and report medians because one run on a shared machine is noisy;
    `spread` gives {"min", "max"} of the headline numbers across the runs so a reader can tell
    a real difference from noise.
    """
    if not summaries:
        raise ValueError("summaries must contain at least one summary")
    out = _median(list(summaries))
    spread: dict[str, dict[str, float]] = {}
    for name, (group, key) in _HEADLINE.items():
        vals = [float(s[group][key]) for s in summaries if key in s.get(group, {})]
        if vals:
            spread[name] = {"min": min(vals), "max": max(vals)}
    out["spread"] = spread
    return out
