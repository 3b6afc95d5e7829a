"""Where a decode step goes: one stage's decode step, op by op, against the matmul floor.

    stagewise profile-decode --stage 9 --model smollm2-135m --batch 16 --prompt-len 160 \\
        --json docs/results/cpu/profile.s09_batched_worker_lookups.b16.cpu.json

`x floor` (the benches' decode step over the model's matmuls alone, common/bench/floor.py) says how
much of a step is overhead; this says which overhead. B requests of random prompt tokens run
through the stage's offline `generate` (one static batch, EOS ignored). A decode step runs from
one one-token forward to the next: the forward, sampling and the engine's bookkeeping, as the
benches' `decode step ms`. The steps are timed without a profiler, then profiled with
torch.profiler in a second run of the same batch, and every op's own time goes in one group:

- matmul: the projections and the lm_head (`aten::mm`, `aten::addmm`, or oneDNN's
  `mkldnn::_linear_pointwise` where the weights are packed): what the floor times;
- attention: scaled-dot-product attention itself;
- kv_cache: reading and writing the paged cache (block gathers, index copies; stage 02 writes its
  contiguous cache with slice copies, which land in "other");
- other: norms, RoPE, activations, residual adds, views, and everything else.

The floor's own matmuls are profiled the same way, so `matmul_vs_floor` compares the same ops
under the same profiler: above 1, the model's matmuls run slower inside a step than alone.
The matmul floor leaves out the K/V, which a step must read too: `kv_read_floor_ms` is the time
to read those bytes once (every row's cached tokens, every layer; `kv_bytes_per_step`) at the
speed this machine streams memory, measured in the same process (common/bench/floor.py), and
`attention_vs_kv_read_floor` compares the attention and kv_cache groups with it.
`attention_free_step_ms` is the same model's forward for the batch with attention replaced by a
no-op, and the greedy pick (common/bench/floor.py): every other op of a step, as eager PyTorch runs
them. `x_floor_bound` = (that + the K/V read floor) / the matmul floor is the least `x floor` any
attention design reaches with this forward at this batch and context, since a step runs the two
one after the other; a stage's `x floor` above it is its attention's and its engine's cost.
The groups are shares of the profiled step (the profiler adds a few microseconds per op, and
Python between ops shows in no op); `decode_step_ms` is the unprofiled median.

On CUDA an op's CPU time is what it costs to launch; the GPU's own time is counted per op too
(`kernel_ms_per_step`, from the kernels each op launched), and `kernel_share_of_step` says how
much of the unprofiled step the GPU spends computing. The rest, kernel launches, Python and the
host's wait, is what CUDA graphs or fewer kernels per layer would remove. Where the steps replay
CUDA graphs (stage 12 on, on a GPU), their kernels belong to no op: `graph_replays` says so, the
comparisons of the matmul and attention groups are left out (None), and the step may go below
`x_floor_bound`, which is eager PyTorch's.
"""
from __future__ import annotations

import argparse
import inspect
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import common.bench.envinfo  # noqa: F401  at start: its GIT_AT_START is the code this run measures
from common.bench.flags import output_file
from common.bench.knobs import add_enforce_eager_arg
from common.bench.profiling import (GRAPH_KERNELS, graph_replays, group_fields, has_knob, kernel_fields, op_table,
                                    report_lines, result_head, stage_class, stage_engine)
from common.bench.report import dtype_lines, unpacked_rows_lines
from common.commands import add_model_args, run_command
from common.config import ModelConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise profile-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="9")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16, help="requests in the batch (one decode row each)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="stage 14: ranks the model is split across (the profile is rank 0's)")
    add_enforce_eager_arg(p)
    p.add_argument("--prompt-len", type=int, default=160, help="random prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed and profiled (after 4 skipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="ops listed in the report")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH")
    return p


def decode_tokens(a: argparse.Namespace, engine_class: Any, config: ModelConfig) -> int:
    """How many tokens each request generates for the timed window; a ValueError where the
    prompt leaves them no room in the context window."""
    new_tokens = DecodeWindow.SKIP + a.steps + 2  # the window's last step ends where one more starts
    knob = inspect.signature(engine_class).parameters.get("max_num_batched_tokens")
    if knob is not None:  # chunked prefill (stage 11): the first prompts decode while the last are
        # prefilled, so they need enough tokens to still be running when the whole batch decodes
        # together. Their decode rows share each step's budget with the chunks: at most `batch` of it.
        budget = int(knob.default)
        if a.batch > budget:  # the engine's own rule: a step's decode rows alone must fit its budget
            raise ValueError(f"--batch {a.batch}: this stage's steps hold at most {budget} tokens "
                             f"(its max_num_batched_tokens), one per decode row")
        new_tokens += -(-a.batch * a.prompt_len // max(budget - a.batch, 1)) + 1
    window_len = config.max_position_embeddings
    if a.prompt_len + new_tokens > window_len:  # the requests would stop (or be cut) before the window is timed
        room = f"at most --prompt-len {window_len - new_tokens}" if window_len > new_tokens else "lower --steps"
        raise ValueError(f"--prompt-len {a.prompt_len} leaves no room in the model's context window "
                         f"({window_len} tokens) for the {new_tokens} decode steps it runs (--steps {a.steps}); {room}")
    return new_tokens


class DecodeWindow:
    """Wraps the model's forward (and from stage 12 the decode graphs' `run`) to find the decode
    steps: a step runs from one forward of one token per row to the next (the forward, sampling,
    the engine's bookkeeping), as the benches' `decode step ms` does. Times every step, and
    profiles a window of `steps` of them."""

    SKIP = 4  # the first decode steps of a batch: allocator and cache warm-up

    def __init__(self, model: torch.nn.Module, steps: int, batch: int, device: torch.device,
                 counts: Counter | None = None, graphs: Any = None) -> None:
        self.steps, self.batch, self.device = steps, batch, device
        self.forward = model.forward
        self.starts: list[float] = []
        self.counts = counts  # a tensor-parallel engine's running count of its collectives (stage 14)
        self.window_counts: Counter = Counter()  # theirs over the window's steps
        self.prof: Any = None
        self.active = False  # only forwards inside run() count (the floors call the model too)
        model.forward = self  # instance attribute: nn.Module.__call__ finds it
        # Stage 12 on: a decode step that replays a CUDA graph never calls the model's forward, so
        # such a step starts at the graphs' `run` (on a CPU, `run` calls the forward: counted once).
        self.in_run = False
        if graphs is not None:
            self.graphs_run = graphs.run
            graphs.run = self.run_graph

    def __call__(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # A decode step starts (and the previous one ended): one token per row, as `[B, 1]`, or
        # packed as `[1, B]` (stage 11's steps). A prefill (or a chunk of one) has more tokens.
        if self.active and not self.in_run and ids.numel() == self.batch:
            self.step_starts()
        return self.forward(ids, *args, **kwargs)

    def run_graph(self, ids: list[int], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The graphs' `run`, wrapped: a decode step of `len(ids)` rows starts."""
        if self.active and len(ids) == self.batch:
            self.step_starts()
        self.in_run = True
        try:
            return self.graphs_run(ids, *args, **kwargs)
        finally:
            self.in_run = False

    def step_starts(self) -> None:
        """Time a step's start (the end of the one before); start and stop the profiler and the
        collectives' count at the window's edges."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = len(self.starts)
        if self.prof is not None and n == self.SKIP:
            self.prof.start()
        if self.prof is not None and n == self.SKIP + self.steps:
            self.prof.stop()
        if self.counts is not None and n in (self.SKIP, self.SKIP + self.steps):
            self.window_counts = Counter(self.counts) - self.window_counts  # at the end: the window's
        self.starts.append(time.perf_counter())

    def run(self, engine: Any, requests: list, profiled: bool) -> list[float]:
        """One generate() of `requests`; the window's step times (ms)."""
        self.starts, self.window_counts = [], Counter()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=activities) if profiled else None
        self.active = True
        try:
            engine.generate(requests)
        finally:
            self.active = False
            if self.prof is not None and self.SKIP < len(self.starts) <= self.SKIP + self.steps:
                self.prof.stop()  # the run ended inside the window: a profiler left on would refuse the next
        if len(self.starts) < self.SKIP + self.steps + 1:
            raise RuntimeError(f"saw {len(self.starts)} decode steps of {self.batch} rows; the window needs "
                               f"{self.SKIP + self.steps + 1} (--steps {self.steps} after {self.SKIP} skipped)")
        window = self.starts[self.SKIP:self.SKIP + self.steps + 1]
        return [(b - a) * 1000.0 for a, b in zip(window, window[1:])]


def measure(a: argparse.Namespace) -> dict:
    from common.bench.floor import (attention_free_ms, decode_matmuls, kv_bytes_per_step, matmul_floor_ms, read_floor_ms,
                                    threads)
    from common.requests import Request, SamplingParams
    from common.bench.workloads import model_token_range, random_token_ids

    machine_threads = torch.get_num_threads()  # the floors' (a CPU tensor-parallel engine splits them among its ranks)
    package, engine_class, config = stage_class(a)
    # What a stage without the knob cannot do (its only way is one rank, eager steps): the profile
    # would be of its own steps, its JSON recording the flag as if applied. One rank or eager is what it does.
    for flag, knob, asks in (("--tensor-parallel-size", "tensor_parallel_size", a.tensor_parallel_size not in (None, 1)),
                             ("--no-enforce-eager", "enforce_eager", a.enforce_eager is False)):
        if asks and not has_knob(engine_class, knob):
            raise ValueError(f"{flag}: {package} takes no {knob}")
    new_tokens = decode_tokens(a, engine_class, config)  # before the weights load
    loaded, engine = stage_engine(a, engine_class, {"max_batch_size": a.batch, "enforce_eager": a.enforce_eager,
                                                    "tensor_parallel_size": a.tensor_parallel_size})
    rng = random.Random(a.seed)
    vocab = loaded.model.lm_head_weight.shape[0]
    ids = [random_token_ids(rng, a.prompt_len, *model_token_range(vocab)) for _ in range(a.batch)]
    requests = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False))
                for p in ids]
    # The model the engine runs: the loaded one, or (tensor parallel) rank 0's share of it
    tp = getattr(engine, "tp", None)
    tp_size = tp.size if tp is not None else 1
    graphs = getattr(engine, "graphs", None)  # stage 12 on: the decode steps that replay
    window = DecodeWindow(getattr(engine, "model", loaded.model), a.steps, a.batch, loaded.device,
                          tp.counts if tp_size > 1 else None, graphs)
    window.run(engine, requests, profiled=False)  # warm-up: every KV block touched once
    with threads(machine_threads):
        floors = [matmul_floor_ms(loaded.model, a.batch, min_time_s=0.3)]
    times = window.run(engine, requests, profiled=False)
    collectives = {k: v / a.steps for k, v in sorted(window.window_counts.items())}  # per step, in the timed run
    if tp_size > 1 and loaded.device.type == "cuda" and graphs is not None:
        collectives = None  # a replayed graph runs its collectives without passing the Python that counts them
    with threads(machine_threads):
        floors.append(matmul_floor_ms(loaded.model, a.batch, min_time_s=0.3))
        free_ms = attention_free_ms(loaded.model, a.batch, min_time_s=0.3)  # same minutes as the floors
    window.run(engine, requests, profiled=True)
    cuda = loaded.device.type == "cuda"
    ops = op_table(window.prof, a.steps, kernels=cuda)
    with threads(machine_threads), profile(activities=[ProfilerActivity.CPU]) as floor_prof:
        matmul_floor_ms(loaded.model, a.batch, warmup=2, repeats=a.steps)
    floor_mm = sum(r["ms_per_step"] for r in op_table(floor_prof, a.steps + 2) if r["group"] == "matmul")  # warm-up + repeats
    fields = group_fields(ops)
    profiled_ms, groups = fields["profiled_ms"], fields["groups_ms_profiled"]
    # Decode step n (from 0) attends over prompt_len + n + 1 tokens; the mean over the timed window:
    context = a.prompt_len + DecodeWindow.SKIP + (a.steps - 1) / 2 + 1
    kv_bytes = kv_bytes_per_step(loaded.config, a.batch, context, loaded.model.lm_head_weight.element_size())
    with threads(machine_threads):
        kv_floor = read_floor_ms(kv_bytes, loaded.dtype, loaded.device)
    kv_ms = groups["attention"] + groups["kv_cache"]
    step_ms, floor_ms = statistics.median(times), statistics.median(floors)
    kernel = kernel_fields(ops) if cuda else {}
    if cuda:  # how much of a step the GPU computes; the rest is launching, Python and waiting
        kernel["kernel_share_of_step"] = kernel["kernel_ms_per_step"] / step_ms if step_ms else None
    replayed = graph_replays(ops)  # then the step's matmuls and attention are in no op's row
    return {
        **result_head("profile-decode", package, loaded, a),
        "batch": a.batch, "prompt_len": a.prompt_len, "steps": a.steps,
        "matmuls_per_step": len(decode_matmuls(loaded.model)), "matmul_unpacked_rows": loaded.model.unpacked_rows,
        "decode_step_ms": step_ms, "step_samples_ms": [round(t, 3) for t in times],
        "floor_ms": floor_ms, "floor_samples_ms": [round(f, 3) for f in floors],
        "x_floor": step_ms / floor_ms if floor_ms else None,
        "profiled_step_ms": profiled_ms,
        "groups_ms_profiled": groups, "groups_share": fields["groups_share"],
        "floor_matmul_ms_profiled": floor_mm,
        "graph_replays": replayed,
        "matmul_vs_floor": groups["matmul"] / floor_mm if floor_mm and not replayed else None,
        "kv_context_tokens": context, "kv_bytes_per_step": kv_bytes, "kv_read_floor_ms": kv_floor,
        "attention_vs_kv_read_floor": kv_ms / kv_floor if kv_floor and not replayed else None,
        "attention_free_step_ms": free_ms,
        "tensor_parallel_size": tp_size, "collectives_per_step": collectives,
        "x_floor_bound": (free_ms + kv_floor) / floor_ms if floor_ms else None,
        **kernel,
        "ops": ops[:max(a.top, 40)] + [r for r in ops[max(a.top, 40):] if r["op"] == GRAPH_KERNELS],
    }


def format_profile(r: dict, top: int) -> str:
    lines = [f"=== decode step profile: {r['stage']} on {r['model']} ({r['device']}, {r['dtype']}) ===",
             *dtype_lines(r),
             f"Batch {r['batch']} rows, {r['prompt_len']}-token prompts, {r['steps']} decode steps",
             f"Decode step (no profiler): {r['decode_step_ms']:.2f} ms median; matmul floor {r['floor_ms']:.2f} ms; "
             f"x floor {r['x_floor']:.2f}", *unpacked_rows_lines(r)]
    replayed = r.get("graph_replays", graph_replays(r.get("ops", [])))  # older files: from their op rows
    if replayed:
        lines.append("The steps replayed CUDA graphs: their kernels belong to no op, so the groups below "
                     "cannot split the matmuls or attention from the rest (their total: GPU kernels, below)")
    else:
        lines.append(f"Matmuls in the step vs the same matmuls alone (both profiled): "
                     f"{r['groups_ms_profiled']['matmul']:.2f} vs {r['floor_matmul_ms_profiled']:.2f} ms "
                     f"= {r['matmul_vs_floor']:.2f}x")
    if "kv_read_floor_ms" in r:
        kv_ms = r["groups_ms_profiled"]["attention"] + r["groups_ms_profiled"]["kv_cache"]
        lines.append(f"K/V a step must read: {r['kv_bytes_per_step'] / 2**20:.2f} MiB ({r['batch']} rows x "
                     f"{r['kv_context_tokens']:.0f} tokens, every layer), {r['kv_read_floor_ms']:.3f} ms at this "
                     f"machine's memory speed" + ("" if replayed else f"; attention and KV cache ops took "
                                                  f"{kv_ms:.2f} ms = {r['attention_vs_kv_read_floor']:.2f}x that"))
    if "x_floor_bound" in r:
        lines.append(f"Without attention (the same forward, attention a no-op, eager): "
                     f"{r['attention_free_step_ms']:.2f} ms = {r['attention_free_step_ms'] / r['floor_ms']:.2f}x floor")
        lines.append(f"Least x floor any attention can reach in eager PyTorch (that + reading the K/V once): "
                     f"{r['x_floor_bound']:.2f}" + ("; a replayed graph launches once, so its step can go below"
                                                   if replayed else ""))
    if "kernel_ms_per_step" in r:  # a CUDA profile
        lines.append(f"GPU kernels: {r['kernel_ms_per_step']:.2f} ms of the {r['decode_step_ms']:.2f} ms step "
                     f"({100 * r['kernel_share_of_step']:.0f} %); the rest is launches, Python and waiting. By group: "
                     + ", ".join(f"{g} {ms:.2f}" for g, ms in r["groups_kernel_ms"].items()))
    if r.get("tensor_parallel_size", 1) > 1 and r["collectives_per_step"] is None:
        lines.append("Communication: not counted, since the window's steps replay CUDA graphs, whose collectives "
                     "run without the Python that counts them")
    elif r.get("tensor_parallel_size", 1) > 1:  # stage 14: what the ranks exchange a step, and what it costs rank 0
        c = r["collectives_per_step"]
        lines.append(f"Communication, rank 0 of {r['tensor_parallel_size']}: a step runs "
                     f"{c.get('all_reduce', 0):.0f} all-reduces ({c.get('all_reduce_bytes', 0) / 1024:.1f} KiB), "
                     f"{c.get('gather', 0):.0f} gather of the logits ({c.get('gather_bytes', 0) / 1024:.1f} KiB) "
                     f"and {c.get('broadcast', 0):.0f} broadcast of the step ({c.get('broadcast_bytes', 0) / 1024:.1f} KiB); "
                     f"{r['groups_ms_profiled']['communication']:.2f} ms of the profiled step "
                     f"({100 * r['groups_share']['communication']:.0f} %), waiting for the other ranks included")
    lines.append(f"Profiled step: {r['profiled_step_ms']:.2f} ms of ops per step, by group:")
    return "\n".join(lines + report_lines(r, top, "step"))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.batch < 1 or a.prompt_len < 1 or a.steps < 1:
        raise ValueError("--batch, --prompt-len and --steps must be >= 1")
    torch.manual_seed(a.seed)
    result = measure(a)
    from common.bench.results import print_and_write
    return print_and_write("profile-decode", result, format_profile(result, a.top), a.json, argv)


if __name__ == "__main__":  # as `stagewise profile-decode`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise profile-decode"))
