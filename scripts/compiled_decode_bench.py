"""A decode step compiled by `torch.compile` against the same step run eagerly: what a compiler buys
the ops around the matmuls on a CPU, with the stage's paged attention left as it is.

    python scripts/compiled_decode_bench.py --dtype bfloat16 --batch 1 16 64 --rounds 3 --json FILE

The step is the newest stage's through its padded buckets (`enforce_eager=False`, stage 12's path:
a step of B rows runs the bucket function `DecodeGraphs.forward`, shapes fixed as a graph needs):

- **eager**: as the stages run it, weights packed for oneDNN (`common/linear.py`);
- **compiled**: the model's forward in that bucket compiled by inductor, one graph per batch size,
  the weights frozen into it (inductor then packs them itself, for oneDNN in bf16 and for MKL in
  fp32, so the eager packing is left out). Attention stays out of the graph, as vLLM keeps it out (its `unified_attention`
  custom op): one opaque op a layer, `stagewise_question::attention`, that calls the stage's own
  paged attention. Traced into the graph (tried by hand), the pool's writes and gathers became
  inductor's own loops, and at 16 and 64 rows the step was slower than the eager one.

Each (form, batch) runs in a process of its own, alternated, the order flipped each round: the
median step over `profile-decode`'s window of steps (`DecodeWindow`), on its random prompts. The
eager process also times the matmul floor; the compiled one its compiles, cold (each process has an
inductor cache of its own, empty), and counts its graphs. Both decode the same
prompts greedily, and the share of identical tokens says the compiled step computes the same thing
(in bf16 a fused graph rounds differently, so a few may part). In fp32 the eager process also times
the matmuls the way inductor runs them (`exact_pack_floor_ms`): part of what the compiled step gains
there is not fusion but MKL's weights packed for exactly its batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common.model  # noqa: E402
from common.bench.floor import decode_matmuls, matmul_floor_ms, median_ms  # noqa: E402
from common.bench.parity import first_difference  # noqa: E402
from common.bench.profile_decode import DecodeWindow, decode_tokens  # noqa: E402
from common.bench.profiling import stage_class, stage_engine  # noqa: E402
from common.bench.results import write_script_result  # noqa: E402
from common.bench.spawn import REPO_ROOT, child_env  # noqa: E402
from common.bench.workloads import model_token_range, random_token_ids  # noqa: E402
from common.requests import Request, SamplingParams  # noqa: E402

FORMS = ("eager", "compiled")
_CURRENT: list[Any] = [None]  # the attention of the bucket forward now running (the op's way to it)
_CALLS = [0]  # how many times the op ran: a compiled step that reached it, once a layer


@torch.library.custom_op("stagewise_question::attention", mutates_args=())
def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The running step's own attention, as one op the compiler does not look into. It writes the
    paged pool, which the graph never sees: to inductor it is a function of q, k and v."""
    _CALLS[0] += 1
    return _CURRENT[0](layer_idx, q, k, v)


@opaque_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return q.new_empty(q.shape)  # [B, T, Hq, D], as every attention returns


def through_op(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What the compiled forward passes the model as its attention (`common.model.Attention`)."""
    return torch.ops.stagewise_question.attention(q, k, v, layer_idx)


def prepare_compile() -> None:
    """Before the model loads: no eager packing (inductor's freezing packs the frozen weights), and
    no cuDNN switch around the layers (a query of torch's global flag, which dynamo cannot trace;
    cuDNN is CUDA's only)."""
    common.model.pack = lambda weight: None
    common.model.cudnn_sdpa = lambda enabled: contextlib.nullcontext()
    torch._inductor.config.freezing = True


def compile_buckets(model: torch.nn.Module, compiles: dict[int, float]) -> None:
    """Route the model's bucket forwards (`captured=True`) through `torch.compile`; every other
    forward (a prefill, a chunk) stays eager. `compiles`: batch size -> seconds of its first call."""
    eager = model.forward
    compiled = torch.compile(lambda ids, positions, rows: eager(ids, positions, through_op, logits_indices=rows),
                             dynamic=False, fullgraph=True)  # fullgraph: a graph break is an error, not a quiet eager piece

    def forward(ids: torch.Tensor, positions: torch.Tensor, attention: Any, logits_indices: Any = None,
                captured: bool = False) -> torch.Tensor:
        if not captured:
            return eager(ids, positions, attention, logits_indices=logits_indices)
        _CURRENT[0] = attention
        first, start = ids.shape[-1] not in compiles, time.perf_counter()
        out = compiled(ids, positions, logits_indices)  # [G, V]
        if first:
            compiles[ids.shape[-1]] = time.perf_counter() - start
        return out

    model.forward = forward


@torch.inference_mode()
def exact_pack_floor_ms(model: torch.nn.Module, batch: int) -> float | None:
    """fp32 only: the step's matmuls as inductor runs a frozen fp32 weight, through MKL's packed
    sgemm (`mkl._mkl_linear`), every weight packed for exactly `batch` rows. MKL's packing serves
    only the rows it was packed for (any other count runs the plain product), so an eager engine,
    whose batch changes from step to step, would need a copy of the weights for every size."""
    if model.lm_head_weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(batch, w.shape[1], generator=gen), torch.ops.mkl._mkl_reorder_linear_weight(w, batch), w, b)
            for w, b, _, _ in decode_matmuls(model)]

    def step() -> None:
        for x, packed, w, b in mats:
            torch.ops.mkl._mkl_linear(x, packed, w, b, batch)

    return median_ms(step, torch.device("cpu"), warmup=5, repeats=30, min_time_s=0.3)


def measure(form: str, batch: int, a: argparse.Namespace) -> dict:
    """One form at one batch size, in this process: the window's step times, and the tokens."""
    args = argparse.Namespace(stage=a.stage, model=a.model, device="cpu", dtype=a.dtype, batch=batch,
                              prompt_len=a.prompt_len, steps=a.steps)
    package, engine_class, config = stage_class(args)
    new_tokens = decode_tokens(args, engine_class, config)  # the window's, and a chunked prefill's lead
    if form == "compiled":
        prepare_compile()
    loaded, engine = stage_engine(args, engine_class, {"max_batch_size": batch, "enforce_eager": False})
    compiles: dict[int, float] = {}
    if form == "compiled":
        compile_buckets(loaded.model, compiles)
    rng = random.Random(a.seed)
    token_range = model_token_range(loaded.model.lm_head_weight.shape[0])
    requests = [Request(prompt_token_ids=random_token_ids(rng, a.prompt_len, *token_range),
                        params=SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)) for _ in range(batch)]
    window = DecodeWindow(loaded.model, a.steps, batch, loaded.device, graphs=engine.graphs)
    window.run(engine, requests, profiled=False)  # warm-up (and the compiles)
    times = window.run(engine, requests, profiled=False)
    tokens = [c.token_ids for c in engine.generate(requests)]
    floor = matmul_floor_ms(loaded.model, batch, min_time_s=0.3) if form == "eager" else None
    exact = exact_pack_floor_ms(loaded.model, batch) if form == "eager" else None
    return {"form": form, "batch": batch, "stage": package.rsplit(".", 1)[-1], "dtype": str(loaded.dtype).removeprefix("torch."),
            "step_ms": statistics.median(times), "step_samples_ms": [round(t, 3) for t in times],
            "floor_ms": floor, "exact_pack_floor_ms": exact, "compile_s": compiles, "attention_op_calls": _CALLS[0],
            "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), "tokens": tokens}


def spawn(form: str, batch: int, a: argparse.Namespace) -> dict:
    """`measure` in a fresh process of this script (its last stdout line is the JSON)."""
    cmd = [sys.executable, __file__, "--child", form, str(batch), "--stage", a.stage, "--model", a.model,
           "--dtype", a.dtype, "--steps", str(a.steps), "--prompt-len", str(a.prompt_len), "--seed", str(a.seed)]
    with tempfile.TemporaryDirectory(prefix="stagewise-inductor-") as cache:  # every compile cold, none from a cache
        env = {**child_env(), "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two runs' tokens agree, each request up to where they first part."""
    agree = total = 0
    for x, y in zip(a, b):
        at = first_difference(x, y)
        agree, total = agree + (len(x) if at is None else at), total + max(len(x), len(y))
    return agree / total if total else 1.0


def summarize(runs: list[dict]) -> list[dict]:
    """Per batch size: each form's median step over its processes, the ratio, the floor, the tokens."""
    rows = []
    for batch in sorted({r["batch"] for r in runs}):
        by = {f: [r for r in runs if r["batch"] == batch and r["form"] == f] for f in FORMS}
        eager, compiled = (statistics.median(r["step_ms"] for r in by[f]) for f in FORMS)
        floor = statistics.median(r["floor_ms"] for r in by["eager"])
        exact = [r["exact_pack_floor_ms"] for r in by["eager"] if r.get("exact_pack_floor_ms") is not None]
        rows.append({
            "batch": batch, "eager_ms": eager, "compiled_ms": compiled, "compiled_vs_eager": compiled / eager,
            "floor_ms": floor, "eager_x_floor": eager / floor, "compiled_x_floor": compiled / floor,
            "exact_pack_floor_ms": statistics.median(exact) if exact else None,
            "samples_ms": {f: [round(r["step_ms"], 3) for r in by[f]] for f in FORMS},
            "ratio_per_round": [round(c["step_ms"] / e["step_ms"], 4) for e, c in zip(by["eager"], by["compiled"])],
            "compile_s": statistics.median(s for r in by["compiled"] for s in r["compile_s"].values()),
            "compile_s_per_round": [r["compile_s"] for r in by["compiled"]],
            "same_tokens": same_tokens(by["eager"][0]["tokens"], by["compiled"][0]["tokens"]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default="14")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=10, help="decode steps timed (after DecodeWindow.SKIP)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=2, metavar=("FORM", "BATCH"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.child[0], int(a.child[1]), a)), flush=True)
        return 0
    runs = []
    for r in range(a.rounds):  # alternated, the order flipped each round
        for batch in a.batch:
            for form in (FORMS if r % 2 == 0 else FORMS[::-1]):
                runs.append(spawn(form, batch, a))
                print(f"round {r + 1} batch {batch} {form}: {runs[-1]['step_ms']:.2f} ms", flush=True)
    rows = summarize(runs)
    for row in rows:
        print(f"batch {row['batch']}: eager {row['eager_ms']:.2f} ms ({row['eager_x_floor']:.2f}x floor), compiled "
              f"{row['compiled_ms']:.2f} ({row['compiled_x_floor']:.2f}x): {row['compiled_vs_eager']:.3f}x; "
              f"compile {row['compile_s']:.1f} s; same tokens {row['same_tokens']:.1%}")
    if a.json:
        result = {"kind": "compiled-decode-bench", "stage": runs[0]["stage"], "dtype": runs[0]["dtype"],
                  "threads": torch.get_num_threads(), "torch": torch.__version__, "steps": a.steps,
                  "prompt_len": a.prompt_len, "rounds": a.rounds, "batches": rows}
        write_script_result(a.json, result, "compiled_decode_bench.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
