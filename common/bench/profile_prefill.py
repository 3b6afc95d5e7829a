"""Where a prefill goes: one prompt's forward, op by op, against its matmul floor.

    stagewise profile-prefill --stage 9 --model smollm2-135m --prompt-len 2000 \\
        --json docs/results/cpu/profile-prefill.s09_batched_worker_lookups.p2000.cpu.json

A prefill of N tokens makes every projection a decode step makes, on N rows at once (and the
lm_head on the last row only: only its logits are sampled). Those products alone, on the same
weights, dtype and device, in the same process, are the prefill's floor, as `common/bench/floor.py`
times them for a decode step; `x floor` (prefill / floor) is what the rest costs: attention,
which grows with N², the norms, RoPE and activations, and the K/V written to the cache. The
floor's own rate (`matmul_gflops`, floating-point operations of the projections per second) says
how close the products run to what this machine's matmul library does at these shapes.

One request of random prompt tokens goes through the stage's offline `generate` with one new
token, so the forwards of the run are the prefill (several, when stage 11 chunks it: the prefill
runs from the first one's start to the last one's end). The prefix cache is off. With it on,
each run's blocks would stay cached and the next run would take blocks the pool has never
used, and the pool is backed by memory lazily (`torch.empty`): a block's first use costs the
OS's page faults for every layer's K and V (60 ms for a 256-token prompt's 16 blocks here),
a cost of the pool's first pass, not of a prefill. Without it, a run's blocks go back to the
pool and the next run reuses them. One warm-up run, then `--repeats` timed
runs with a floor sample after each, then one run under torch.profiler, its ops grouped as
`stagewise profile-decode` groups them (the profiled run is the whole `generate`: the prefill,
then sampling its one token and the engine's bookkeeping, a small share of a long prefill).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import common.bench.envinfo  # noqa: F401  at start: its GIT_AT_START is the code this run measures
from common.bench.flags import output_file
from common.bench.profiling import (group_fields, has_knob, kernel_fields, op_table, report_lines, result_head,
                                    stage_class, stage_engine)
from common.bench.report import dtype_lines
from common.commands import add_model_args, run_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise profile-prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="9")
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=2000, help="random prompt tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills (after one warm-up)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="stage 11's token budget a step, so its chunk size (default: the stage's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="ops listed in the report")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH")
    return p


class PrefillTimer:
    """Wraps the model's forward: the prefill runs from the first forward of a run to the end of
    the last (one forward, or stage 11's chunks), synchronised on CUDA."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.forward, self.device = model.forward, device
        self.spans: list[tuple[float, float]] = []
        model.forward = self  # instance attribute: nn.Module.__call__ finds it

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = self._now()
        out = self.forward(*args, **kwargs)
        self.spans.append((start, self._now()))
        return out

    def run(self, engine: Any, request_factory: Any) -> float:
        """One generate() of a fresh request; its prefill in ms."""
        self.spans = []
        engine.generate([request_factory()])
        return (self.spans[-1][1] - self.spans[0][0]) * 1000.0


def projection_flops(model: torch.nn.Module, rows: int) -> float:
    """Floating-point operations of a prefill's projections: 2 * in * out per row and product,
    every layer's on `rows` rows, the lm_head's on one."""
    from common.bench.floor import decode_matmuls
    mats = decode_matmuls(model)
    per_row = sum(w.shape[0] * w.shape[1] for w, *_ in mats[:-1])
    lm_head = mats[-1][0]
    return 2.0 * (rows * per_row + lm_head.shape[0] * lm_head.shape[1])


def attention_flops(config: Any, tokens: int) -> float:
    """Floating-point operations of causal attention over a prompt: every query-key pair with the
    key not after the query, for q.k and for p.v (2 * head_dim each), every query head and layer."""
    pairs = tokens * (tokens + 1) / 2
    return 4.0 * pairs * config.head_dim * config.num_heads * config.num_layers


def measure(a: argparse.Namespace) -> dict:
    from common.bench.floor import matmul_floor_ms
    from common.requests import Request, SamplingParams
    from common.bench.workloads import model_token_range, random_token_ids

    # Prefix cache off: a random prompt never hits it, and without it each run's blocks go back to
    # the pool, so the timed runs reuse the blocks the warm-up touched (see the module docstring).
    package, engine_class, config = stage_class(a)  # the flags checked before the model loads
    if a.max_num_batched_tokens is not None and not has_knob(engine_class, "max_num_batched_tokens"):
        raise ValueError(f"--max-num-batched-tokens: {package} prefills whole prompts "
                         "(stage 11 chunks them)")
    if a.prompt_len > config.max_position_embeddings:  # the prompt would be cut to the window, and the report lie about it
        raise ValueError(f"--prompt-len {a.prompt_len} is longer than the model's context "
                         f"window ({config.max_position_embeddings} tokens)")
    loaded, engine = stage_engine(a, engine_class, {"max_batch_size": 1,
                                                    "max_num_batched_tokens": a.max_num_batched_tokens,
                                                    "prefix_cache_max_entries": 0, "enable_prefix_caching": False})
    rng = random.Random(a.seed)
    vocab = loaded.model.lm_head_weight.shape[0]

    def request() -> Request:  # fresh tokens each run: no prefix cache can serve it
        ids = random_token_ids(rng, a.prompt_len, *model_token_range(vocab))
        return Request(prompt_token_ids=ids, params=SamplingParams(max_new_tokens=1, stop_on_eos=False))

    def floor() -> float:
        return matmul_floor_ms(loaded.model, a.prompt_len, warmup=1, repeats=3, lm_head_rows=1)

    timer = PrefillTimer(loaded.model, loaded.device)
    timer.run(engine, request)  # warm-up
    times, floors = [], []
    for _ in range(a.repeats):
        times.append(timer.run(engine, request))
        floors.append(floor())
    cuda = loaded.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        timer.run(engine, request)
    ops = op_table(prof, 1, kernels=cuda)
    fields = group_fields(ops)
    kernel = kernel_fields(ops) if cuda else {}  # an op's CPU time is then its launch, its kernels the GPU's work
    attention_ms = (kernel["groups_kernel_ms"] if cuda else fields["groups_ms_profiled"])["attention"]
    prefill_ms, floor_ms = statistics.median(times), statistics.median(floors)
    flops = projection_flops(loaded.model, a.prompt_len)
    attn_flops = attention_flops(loaded.config, a.prompt_len)
    return {
        **result_head("profile-prefill", package, loaded, a),
        "prompt_len": a.prompt_len, "prefill_ms": prefill_ms, "prefill_samples_ms": [round(t, 3) for t in times],
        "floor_ms": floor_ms, "floor_samples_ms": [round(f, 3) for f in floors],
        "x_floor": prefill_ms / floor_ms if floor_ms else None,
        "projection_gflop": flops / 1e9,
        "matmul_gflops": flops / floor_ms / 1e6 if floor_ms else None,  # GFLOP/s of the projections alone
        "prefill_gflops": flops / prefill_ms / 1e6 if prefill_ms else None,  # the same work over the whole prefill
        "attention_gflop": attn_flops / 1e9,  # GFLOP/s of attention, from its profiled (kernel) time:
        "attention_gflops_profiled": attn_flops / attention_ms / 1e6 if attention_ms else None,
        **fields, **kernel,
        "ops": ops[:max(a.top, 40)],
    }


def format_profile(r: dict, top: int) -> str:
    lines = [f"=== prefill profile: {r['stage']} on {r['model']} ({r['device']}, {r['dtype']}) ===",
             *dtype_lines(r),
             f"One {r['prompt_len']}-token prompt; {len(r['prefill_samples_ms'])} timed prefills",
             f"Prefill (no profiler): {r['prefill_ms']:.2f} ms median; matmul floor {r['floor_ms']:.2f} ms; "
             f"x floor {r['x_floor']:.2f}",
             f"Projections: {r['projection_gflop']:.1f} GFLOP; alone {r['matmul_gflops']:.1f} GFLOP/s, "
             f"over the whole prefill {r['prefill_gflops']:.1f} GFLOP/s",
             f"Causal attention: {r['attention_gflop']:.1f} GFLOP, at {r['attention_gflops_profiled'] or 0:.1f} GFLOP/s "
             f"(its profiled time)",
             f"Profiled prefill: {r['profiled_ms']:.2f} ms of ops, by group:"]
    return "\n".join(lines + report_lines(r, top, "prefill"))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.prompt_len < 1 or a.repeats < 1:
        raise ValueError("--prompt-len and --repeats must be >= 1")
    torch.manual_seed(a.seed)
    result = measure(a)
    from common.bench.results import print_and_write
    return print_and_write("profile-prefill", result, format_profile(result, a.top), a.json, argv)


if __name__ == "__main__":  # as `stagewise profile-prefill`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise profile-prefill"))
