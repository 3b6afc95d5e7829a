"""The matmul floor at several batch sizes, in one process: where batching stops paying.

    stagewise floor-curve --batches 1,2,4,7,8,16,32,64 --rounds 5 --dtype float32 \\
        --json docs/results/machines/xeon-6-85/floor-curve.cpu.json

A decode step's matmuls (common/bench/floor.py) read every weight once, whatever the batch, and
do arithmetic for every row. At one row a step is the weights' read; as rows are added the
arithmetic grows until it, not the read, sets the time. The floor per row (`ms_per_row`) shows
what batching buys: it falls fast while the read dominates and flattens once arithmetic does.
It also says what more rows can give (stage 13): with steps of nothing but matmuls, N times
the rows give N x floor(b) / floor(N x b) the tokens a second. A real step's costs that grow
with the rows (attention over their context) take from that; a fixed cost per step adds to it.

The batches are timed in rounds, every batch once a round, so that a machine whose speed drifts
from minute to minute slows all of them alike (every other round backwards); each
batch's floor is the median of its rounds. Each sample is `matmul_floor_ms` as the benches take
it (FloorSampler: at least 0.3 s of steps).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import common.bench.envinfo  # noqa: F401  at start: its GIT_AT_START is the code this run measures
from common.bench.flags import output_file
from common.bench.floor import matmul_floor_ms
from common.bench.report import unpacked_rows_lines
from common.commands import add_model_args, run_command


MATMUL_WORDS = {"model": "as the model runs them (common/linear.py: packed, F.linear at the rows it measured faster)",
                "F.linear": "through F.linear",
                "both": "as the model runs them (floor ms), and through F.linear, back to back"}


def batch_list(text: str) -> list[int]:
    """`--batches`: comma-separated batch sizes, each >= 1, no repeats, in the order given."""
    try:
        batches = [int(word) for word in text.split(",")]
    except ValueError:
        raise ValueError(f"--batches: {text!r} is not a comma-separated list of integers") from None
    if min(batches) < 1 or len(set(batches)) != len(batches):
        raise ValueError(f"--batches: every batch size must be >= 1 and given once, got {text!r}")
    return batches


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise floor-curve", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes (rows of one token)")
    p.add_argument("--rounds", type=int, default=3, help="times each batch is timed, all batches once a round")
    p.add_argument("--matmul", choices=("model", "F.linear", "both"), default="model",
                   help="the products as the model runs them (on a CPU, weights packed for oneDNN where "
                        "common/linear.py packs them), through F.linear, or both in turn")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH")
    return p


def measure(model: torch.nn.Module, batches: list[int], rounds: int, matmul: str = "model") -> list[dict]:
    """Each batch's floor samples (one a round, the batches in turn), median and cost per row.
    Every other round runs backwards, so a batch does not always come right after the same one
    (the largest leaves the caches and the clock as the next finds them). `matmul="both"` times
    the model's products and F.linear's back to back, each first in every other round:
    `f_linear_ms` beside `floor_ms`, and their ratio."""
    paths = {"model": [True], "F.linear": [False], "both": [True, False]}[matmul]
    samples: dict[tuple[int, bool], list[float]] = {(b, p): [] for b in batches for p in paths}
    for r in range(rounds):
        for b in (batches if r % 2 == 0 else batches[::-1]):
            for p in (paths if r % 2 == 0 else paths[::-1]):
                samples[b, p].append(matmul_floor_ms(model, b, min_time_s=0.3, packed=p))
    out = []
    for b in batches:
        first = samples[b, paths[0]]
        row = {"batch": b, "floor_ms": statistics.median(first), "samples_ms": first}
        row["ms_per_row"] = row["floor_ms"] / b
        if len(paths) == 2:
            row["f_linear_ms"] = statistics.median(samples[b, False])
            row["f_linear_samples_ms"] = samples[b, False]
            row["f_linear_vs_model"] = row["f_linear_ms"] / row["floor_ms"]
        out.append(row)
    return out


def format_curve(r: dict) -> str:
    """The printed table: each batch's floor, its cost per row, and the floor against the first batch's."""
    first = r["batches"][0]
    lines = [f"=== matmul floor by batch: {r['model']} on {r['device']} ({r['dtype']}) ===",
             f"Dtype: {r['dtype_reason']}",
             f"Method: every batch once a round, {r['config']['rounds']} rounds in one process, medians",
             f"Products: {MATMUL_WORDS[r['config'].get('matmul', 'model')]}", *unpacked_rows_lines(r),
             f"{'batch':>6} {'floor ms':>10} {'ms / row':>10} {'x b' + str(first['batch']):>8}"
             + (f" {'F.linear ms':>12} {'F / model':>10}" if "f_linear_ms" in first else "") + "   samples (ms)"]
    for row in r["batches"]:
        samples = " ".join(f"{s:.1f}" for s in row["samples_ms"])
        both = f" {row['f_linear_ms']:>12.2f} {row['f_linear_vs_model']:>9.2f}x" if "f_linear_ms" in row else ""
        lines.append(f"{row['batch']:>6} {row['floor_ms']:>10.2f} {row['ms_per_row']:>10.2f} "
                     f"{row['floor_ms'] / first['floor_ms']:>7.2f}x{both}   {samples}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    batches = batch_list(a.batches)
    if a.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
    from common.loader import load_model

    loaded = load_model(a.model, device=a.device, dtype=a.dtype)
    result = {"kind": "floor-curve", "model": loaded.name, "device": str(loaded.device),
              "dtype": str(loaded.dtype).replace("torch.", ""), "dtype_reason": loaded.dtype_reason,
              "threads": torch.get_num_threads(), "config": vars(a),
              "matmul_unpacked_rows": loaded.model.unpacked_rows,
              "batches": measure(loaded.model, batches, a.rounds, a.matmul)}
    from common.bench.results import print_and_write
    return print_and_write("floor-curve", result, format_curve(result), a.json, argv)


if __name__ == "__main__":  # as `stagewise floor-curve`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise floor-curve"))
