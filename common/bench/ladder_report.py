"""The ladder's report: the printed table and the two-panel chart, both from the ladder JSON.

Kept apart from the run (common/bench/ladder.py) so that a committed result can be redrawn without
measuring again -- the numbers come from the JSON, never from a re-run:

    python -m common.bench.ladder_report docs/results/cpu/ladder.cpu.json     # rewrites its .txt and .png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from common.bench.report import dtype_lines

HF_ENGINES = ("hf_generate", "hf_continuous_batching")


def _f(x: Any, digits: int = 2) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def format_table(data: dict) -> str:
    rows = data["entries"]
    base = next((r for r in rows if r["engine"] == "s01_naive_batching"), None)
    head = (f"{'engine':26s} {'mode':9s} {'compl tok/s':>11s} {'total tok/s':>11s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
            f"{'TPOT p50':>9s} {'ITL p99':>9s} {'step ms':>8s} {'x floor':>7s} {'peak KV':>9s} {'x s01':>6s}  tokens")
    lines = [f"=== ladder: {data['model']} on {data['env']['device_name']} ({data['dtype']}) ===",
             *dtype_lines(data),
             f"Workload: {data['workload']['description']}",
             f"Tokens per run: {data['workload']['prompt_tokens']} prompt + {data['workload']['completion_tokens']} "
             f"completion; max batch size {data['config']['max_batch_size']}",
             f"Method: {data['config']['warmup_runs']} warmup + {data['config']['repeat_runs']} "
             f"repeat{'s' if data['config']['repeat_runs'] != 1 else ''}, {_method(data)}, "
             f"medians; times in ms, peak KV in MiB", head, "-" * len(head)]
    for r in rows:
        peak = r["kv"].get("peak_kv_bytes")
        ratio = (r["throughput_tok_s"]["completion"] / base["throughput_tok_s"]["completion"]
                 if base and base["throughput_tok_s"]["completion"] else None)
        ok = {True: "same", False: "DIFFER", None: "—"}[r.get("tokens_match_reference")]
        lines.append(f"{r['engine']:26s} {r['mode']:9s} {_f(r['throughput_tok_s']['completion']):>11s} "
                     f"{_f(r['throughput_tok_s']['total']):>11s} {_f(r['ttft_ms']['p50']):>9s} "
                     f"{_f(r['ttft_ms']['p99']):>9s} {_f(r['tpot_ms']['p50']):>9s} {_f(r.get('itl_ms', {}).get('p99')):>9s} "
                     f"{_f(r.get('decode_step_ms')):>8s} {_f(r.get('x_floor')):>7s} "
                     f"{_f(None if peak is None else peak / 2**20):>9s} {_f(ratio):>6s}  {ok}")
    for s in data["skipped"]:
        lines.append(f"{s['engine']:26s} skipped: {s['reason']}")
    floors = [r["floor_ms"] for r in rows if r.get("floor_ms") is not None]
    if floors:
        batch = next(r.get("floor_batch") for r in rows if r.get("floor_ms") is not None)
        rounds = data["config"].get("rounds", 1)
        where, per = ("process", "that process's floor") if rounds == 1 else \
            (f"{rounds} processes", "the median of its processes' floors")
        lines.append(f"Matmul floor at batch {batch} (the model's matmuls alone, measured in each engine's "
                     f"{where}): {min(floors):.3f}-{max(floors):.3f} ms; x floor = step ms / {per}")
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)


def _method(data: dict) -> str:
    """Old results (no `same_process` in their config) ran every engine in one process."""
    if data["config"].get("same_process", True):
        return "engines alternating in one process"
    rounds = data["config"].get("rounds", 1)
    if rounds > 1:
        runs = rounds * data["config"]["repeat_runs"]
        return f"in each of {rounds} fresh processes per engine, interleaved ({runs} timed runs per engine)"
    return "each engine in its own fresh process"


def write_chart(data: dict, path: Path) -> None:
    """Two panels, one bar per engine: completion throughput, and TTFT (p50 bar, p99 tick)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = data["entries"][::-1]  # top to bottom: stage 01 first
    labels = [r["label"] for r in rows]
    colors = ["#9e9e9e" if r["engine"] in HF_ENGINES else "#5c6bc0" if (r["stage"] or 0) <= 3
              else "#26a69a" if (r["stage"] or 0) <= 9 else "#ef6c00" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.42 * len(rows)), sharey=True)
    tput = [r["throughput_tok_s"]["completion"] for r in rows]
    a.barh(labels, tput, color=colors)
    a.set_xlabel("completion throughput (tokens/s, higher is better)")
    p50, p99 = [r["ttft_ms"]["p50"] for r in rows], [r["ttft_ms"]["p99"] for r in rows]
    b.barh(labels, p50, color=colors)
    b.scatter(p99, labels, marker="|", s=200, color="black", zorder=3)
    log = min(p50) > 0 and max(p99) / min(p50) > 10  # one slow rung would flatten all the others
    b.set_xlabel("time to first token (ms, lower is better" + (", log scale)" if log else ")"))
    groups = [("#5c6bc0", "static batches (01-03)"), ("#26a69a", "continuous batching (04-09)"),
              ("#ef6c00", "past the posts (10+)"), ("#9e9e9e", "Hugging Face")]
    groups = [g for g in groups if g[0] in colors]  # a ladder of a few rungs lists only their groups
    handles = [Patch(color=c, label=t) for c, t in groups]
    handles.append(Line2D([], [], color="black", marker="|", linestyle="", markersize=12,
                          label="TTFT p99 (bar: p50; numbers: p50 / p99)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    for ax, vals in ((a, tput), (b, p50)):
        top = max(vals + ([max(p99)] if ax is b else [])) or 1.0
        if ax is b and log:
            ax.set_xscale("log")
            ax.set_xlim(min(p50) / 2, top * 3.5)
        else:
            ax.set_xlim(0, top * (1.18 if ax is a else 1.35))
        for y, v in enumerate(vals):
            if ax is a:
                ax.text(v + top * 0.01, y, f"{v:,.1f}", va="center", fontsize=8)
            else:  # after the p99 tick, so the number never hides it
                end = max(v, p99[y])
                ax.text(end * 1.08 if log else end + top * 0.015, y, f"{v:,.0f} / {p99[y]:,.0f}",
                        va="center", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    env = data["env"]
    fig.suptitle(f"stagewise ladder — {data['model']} on {env['device_name']} ({data['dtype']}), "
                 f"{data['config']['mode']} mode\n{data['workload']['description']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the legend below
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(data: dict, json_path: Path) -> str:
    """Write the table (.txt) and the chart (.png) beside `json_path`; return the table."""
    table = format_table(data)
    json_path.with_suffix(".txt").write_text(table + "\n")
    write_chart(data, json_path.with_suffix(".png"))
    return table


def main(argv: list[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m common.bench.ladder_report LADDER_JSON...", file=sys.stderr)
        return 2
    for name in paths:
        path = Path(name)
        write_report(json.loads(path.read_text()), path)
        print(f"wrote {path.with_suffix('.txt')} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
