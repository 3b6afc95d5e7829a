"""The text every benchmark prints: the posts' `=== streaming benchmark ===` block.

One fixed format across stages lets a reader compare two runs by eye, line by line. Only the
fields a run measured are printed (the offline stages 01-03 have no submit/queue lines).
`format_comparison` puts several engines side by side, with ratios against the first column
(the stage being benchmarked) and a plain statement of whether a difference beats the noise.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable


def dtype_lines(result: dict) -> list[str]:
    """The line a text report gives to why its dtype was picked (`common.loader.choose_dtype`),
    or none where the result does not say."""
    return [f"Dtype: {result['dtype_reason']}"] if result.get("dtype_reason") else []


def unpacked_rows_lines(result: dict) -> list[str]:
    """The line a text report gives to the projections that go through `F.linear` at a few rows
    (`common.linear.rows_for_f_linear`, measured at load), or none where all are packed or it
    was not recorded."""
    rows = {name: r for name, r in (result.get("matmul_unpacked_rows") or {}).items() if r}
    if not rows:
        return []
    return ["F.linear at few rows (measured at load, packed above): "
            + ", ".join(f"{name} <= {r}" for name, r in rows.items())]

# (summary key, label, unit) in the posts' order.
PERCENTILE_LINES: list[tuple[str, str, str]] = [
    ("submit_lag_ms", "Submit lag", "ms"),
    ("add_request_ms", "add_request latency", "ms"),
    ("tokenize_ms", "Tokenize", "ms"),
    ("queue_wait_ms", "Queue wait (post-tok)", "ms"),
    ("prefill_to_first_token_ms", "Prefill->first token", "ms"),
    ("ttft_ms", "TTFT", "ms"),
    ("tpot_ms", "TPOT", "ms/token"),
    ("itl_ms", "ITL", "ms"),
    ("latency_ms", "Latency", "ms"),
]


def _pct(values: dict) -> str:
    return "/".join(f"{float(values[k]):.2f}" for k in ("p50", "p95", "p99"))


def format_report(summary: dict, header: dict, runs: list[dict] | None = None,
                  title: str = "streaming benchmark") -> str:
    """The posts' block. `header` is an ordered label -> value mapping printed after the title
    (Model, Device, Pretok, ...; None values are skipped); `runs` (per-repeat summaries) adds a
    last line with the run-to-run spread, since the block itself shows medians."""
    lines = [f"=== {title} ==="]
    lines += [f"{label}: {v}" for label, v in header.items() if v is not None]
    for key, label in (("requests", "Requests"), ("prompt_tokens", "Prompt tokens (total)"),
                       ("completion_tokens", "Completion tokens (total)")):
        if key in summary:
            lines.append(f"{label}: {int(summary[key])}")
    if "submit_wall_s" in summary:
        lines.append(f"Submit wall: {float(summary['submit_wall_s']):.6f} s")
    if "submit_interval_ms" in summary:
        lines.append(f"Submit interval/schedule: {float(summary['submit_interval_ms']):.3f} ms / "
                     f"{summary.get('submit_schedule', 'absolute')}")
    for key, label, unit in PERCENTILE_LINES:
        if isinstance(summary.get(key), dict):
            lines.append(f"{label} p50/p95/p99: {_pct(summary[key])} {unit}")
    tput = summary.get("throughput_tok_s")
    if isinstance(tput, dict):
        lines.append(f"Throughput (completion,total): {float(tput['completion']):.2f}/"
                     f"{float(tput['total']):.2f} tokens/s")
    lines += floor_lines(summary) + kv_lines(summary)
    if runs and len(runs) > 1:
        per_run = [float(r["throughput_tok_s"]["completion"]) for r in runs]
        lines.append(f"Runs: {len(runs)} (medians above; completion tokens/s per run: "
                     f"{', '.join(f'{x:.2f}' for x in per_run)}; spread {_spread_pct(per_run):.1f}%)")
    return "\n".join(lines)


def floor_lines(summary: dict) -> list[str]:
    """Decode step, the matmul floor at the decode batch, and their ratio (when measured)."""
    lines = []
    if summary.get("decode_step_ms") is not None:
        lines.append(f"Decode step (ms): {float(summary['decode_step_ms']):.2f}")
    if summary.get("floor_ms") is not None:
        lines.append(f"Matmul floor at batch {summary.get('floor_batch', '?')} (ms): {float(summary['floor_ms']):.3f}")
    if summary.get("x_floor") is not None:
        lines.append(f"x floor: {float(summary['x_floor']):.2f}")
    return lines + unpacked_rows_lines(summary)


def kv_lines(summary: dict) -> list[str]:
    """How full the batch and the KV pool ran, and what preemption cost (where the engine says)."""
    lines, batch, kv = [], summary.get("step_batch"), summary.get("kv") or {}
    if isinstance(batch, dict):
        lines.append(f"Requests per step mean/peak: {float(batch['mean']):.2f}/{int(batch['peak'])}")
    if "kv_usage_mean" in kv:
        waiting = kv.get("kv_usage_mean_while_waiting")
        lines.append(f"KV pool in use mean/peak: {100 * float(kv['kv_usage_mean']):.1f}%/"
                     f"{100 * float(kv['kv_usage_peak']):.1f}%" +
                     ("" if waiting is None else f" (mean {100 * float(waiting):.1f}% while requests waited)"))
    if "num_preemptions" in kv:
        lines.append(f"Preemptions: {int(kv['num_preemptions'])} (recomputed tokens: {int(kv['recomputed_tokens'])})")
    if "eager_steps" in kv:  # stage 12 on: a GPU replays the first kind; the second runs kernel by kernel
        lines.append(f"Steps: {int(kv['graph_steps'])} decode-only through the graphs' buckets, "
                     f"{int(kv['eager_steps'])} eager (with prompt chunks, above the largest bucket, or enforce_eager)")
    return lines


def _spread_pct(values: list[float]) -> float:
    """(max - min) / median, in percent: how much the same run moves by itself."""
    med = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / med if med else 0.0


# ----------------------------------------------------------------------------- comparison

def _get(*path: str) -> Callable[[dict], float | None]:
    def get(result: dict) -> float | None:
        node: Any = result
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return None if node is None else float(node)
    return get


# (ratio key, row label, getter, higher_is_better, display scale)
COMPARISON_ROWS: list[tuple[str, str, Callable[[dict], float | None], bool, float]] = [
    ("throughput_completion", "Throughput completion (tok/s)", _get("throughput_tok_s", "completion"), True, 1.0),
    ("throughput_total", "Throughput total (tok/s)", _get("throughput_tok_s", "total"), True, 1.0),
    ("ttft_p50", "TTFT p50 (ms)", _get("ttft_ms", "p50"), False, 1.0),
    ("ttft_p99", "TTFT p99 (ms)", _get("ttft_ms", "p99"), False, 1.0),
    ("queue_wait_p50", "Queue wait p50 (ms)", _get("queue_wait_ms", "p50"), False, 1.0),
    ("tpot_p50", "TPOT p50 (ms/token)", _get("tpot_ms", "p50"), False, 1.0),
    ("itl_p50", "ITL p50 (ms)", _get("itl_ms", "p50"), False, 1.0),
    ("decode_step", "Decode step (ms)", _get("decode_step_ms"), False, 1.0),
    ("x_floor", "x floor", _get("x_floor"), False, 1.0),
    ("latency_p50", "Latency p50 (ms)", _get("latency_ms", "p50"), False, 1.0),
    ("latency_p99", "Latency p99 (ms)", _get("latency_ms", "p99"), False, 1.0),
    ("wall_s", "Wall (s)", _get("wall_s"), False, 1.0),
    ("peak_kv_bytes", "Peak KV (MiB)", _get("kv", "peak_kv_bytes"), False, 1.0 / 2**20),
    ("step_batch_mean", "Requests per step (mean)", _get("step_batch", "mean"), True, 1.0),
    ("kv_usage_mean", "KV pool in use (mean %)", _get("kv", "kv_usage_mean"), True, 100.0),
    ("preemptions", "Preemptions", _get("kv", "num_preemptions"), False, 1.0),
    ("eager_steps", "Eager steps", _get("kv", "eager_steps"), False, 1.0),
]


def _ratio(first: float | None, other: float | None, higher_is_better: bool) -> float | None:
    """> 1 means the first engine is better (faster, more tokens/s, less memory)."""
    if first is None or other is None:
        return None
    num, den = (first, other) if higher_is_better else (other, first)
    return num / den if den > 0 else None


def comparison_ratios(results: list[dict]) -> dict[str, dict[str, float]]:
    """{other engine: {ratio key: first-vs-other ratio}}; every ratio > 1 favours the first engine."""
    ratios: dict[str, dict[str, float]] = {}
    for other in results[1:]:
        row = {}
        for key, _, get, higher, _ in COMPARISON_ROWS:
            value = _ratio(get(results[0]), get(other), higher)
            if value is not None:
                row[key] = round(value, 4)
        ratios[other["engine"]] = row
    return ratios


def throughput_verdict(first: dict, other: dict) -> str:
    """Does the completion-throughput difference beat the run-to-run spread?"""
    a = [float(r["throughput_tok_s"]["completion"]) for r in first.get("runs") or []]
    b = [float(r["throughput_tok_s"]["completion"]) for r in other.get("runs") or []]
    if len(a) < 2 or len(b) < 2:
        return "too few runs to judge the noise"
    if max(a) < min(b) or max(b) < min(a):
        return "outside the run-to-run spread"
    return "within the noise: per-run ranges overlap"


def format_comparison(results: list[dict]) -> str:
    """Rows = metrics, columns = engines, then one ratio column per other engine."""
    if not results:
        return ""
    first = results[0]["engine"]
    ratios = comparison_ratios(results)
    head = ["metric", *(r["engine"] for r in results), *(f"{first} vs {r['engine']}" for r in results[1:])]
    rows = [head]
    for key, label, get, _, scale in COMPARISON_ROWS:
        values = [get(r) for r in results]
        if all(v is None for v in values):
            continue
        cells = [label, *("-" if v is None else f"{v * scale:.2f}" for v in values)]
        for other in results[1:]:
            ratio = ratios[other["engine"]].get(key)
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out = ["=== comparison (ratios > 1x favour " + first + ") ==="]
    for n, row in enumerate(rows):
        out.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    for other in results[1:]:
        speedup = ratios[other["engine"]].get("throughput_completion")
        if speedup is not None:
            out.append(f"{first} vs {other['engine']}: completion throughput speedup {speedup:.2f}x "
                       f"({throughput_verdict(results[0], other)})")
    return "\n".join(out)
