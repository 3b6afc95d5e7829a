"""Every stage's greedy tokens against transformers' `generate`: one model, device and dtype.

    stagewise parity --model smollm2-135m --dtype float32 --json docs/results/cpu/parity.fp32.cpu.json
    stagewise parity --model smollm2-135m --dtype bfloat16 --json docs/results/cpu/parity.bf16.cpu.json

The tests hold every stage to transformers' tokens exactly, on `tiny` in fp32 (tests/test_parity.py).
This measures the same thing on a real model, in any dtype, on any device: the reference is
transformers' `generate`, one prompt at a time (no padding), greedy, in the same dtype on the same
device, and every stage runs the same prompts batched as it batches them.

In fp32 every token should agree. In bf16 a stage and transformers round the same math in a
different order wherever their shapes differ (padding, a batch of prompts in one forward, a paged
gather, another attention kernel), and a different rounding can tip a near tie between the two
best tokens. So for each row that differs the report gives where (its first differing token:
after it the row goes on from another prefix, and nothing later counts) and why it could: the
reference's margin there, its best logit minus its second best. A margin far above bf16's
rounding would mean a real error, not rounding.
"""
from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from typing import Any

import torch

import common.bench.envinfo  # noqa: F401  at start: its GIT_AT_START is the code this run measures
from common.bench.flags import output_file
from common.bench.report import dtype_lines
from common.commands import add_model_args, run_command

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Explain paged attention to a new engineer in two sentences.",
    "def fibonacci(n):",
    "Write a haiku about a KV cache.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three reasons why batching makes inference faster:",
    "Translate to French: the cache is full, so the request waits.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise parity", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--stages", default="all", help="comma-separated numbers, or all")
    p.add_argument("--random-prompts", type=int, default=8, help="random-token prompts beside the text ones")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_file, default=None, metavar="PATH")
    return p


def stage_numbers(text: str) -> list[int]:
    """`--stages`: "all", or stage numbers (or names) separated by commas; a ValueError naming the flag."""
    from common import stages as registry

    if text == "all":
        return sorted(registry.STAGES)
    try:
        numbers = [registry.stage_number(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as exc:  # the registry's own words name the stage it does not know
        raise ValueError(f"--stages: {str(exc).removeprefix('stage: ')}") from None
    if not numbers:
        raise ValueError(f"--stages: give stage numbers such as 1,4,9, or all; got {text!r}")
    return numbers


def first_difference(ours: list[int], ref: list[int]) -> int | None:
    """Index of the first token where the two differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


@torch.inference_mode()
def reference_top2(hf_model: Any, prompt: list[int], ref: list[int], at: int) -> tuple[float, float] | None:
    """transformers' best and second-best logits before reference token `at`."""
    if at >= len(ref):
        return None  # we generated past the reference's EOS: nothing to compare there
    ids = torch.tensor([prompt + ref[:at]], dtype=torch.long, device=hf_model.device)
    best, second = hf_model(ids).logits[0, -1].float().topk(2).values.tolist()
    return best, second


def reference_margin(hf_model: Any, prompt: list[int], ref: list[int], at: int) -> float | None:
    """transformers' best logit minus its second best before reference token `at`."""
    top2 = reference_top2(hf_model, prompt, ref, at)
    return None if top2 is None else top2[0] - top2[1]


def compare(outputs: list[list[int]], reference: list[list[int]], prompts: list[list[int]], hf_model: Any) -> dict:
    """One stage's rows against the reference: agreement, and each differing row's place and margin."""
    rows, agreed = [], 0
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        at = first_difference(ours, ref)
        agreed += len(ref) if at is None else at
        if at is not None:
            rows.append({"request": i, "first_difference": at, "ours": ours[at] if at < len(ours) else None,
                         "reference": ref[at] if at < len(ref) else None,
                         "reference_margin": reference_margin(hf_model, prompts[i], ref, at)})
    margins = [r["reference_margin"] for r in rows if r["reference_margin"] is not None]
    return {"requests": len(reference), "identical": len(reference) - len(rows),
            "first_tokens_equal": sum(o[:1] == r[:1] for o, r in zip(outputs, reference)),
            "agreement": agreed / max(1, sum(len(r) for r in reference)),
            "max_margin_at_difference": max(margins) if margins else None, "differences": rows}


def measure(a: argparse.Namespace, stages: list[int]) -> dict:
    from common import stages as registry
    from common.bench.knobs import accepted
    from common.bench.hf_baseline import HFGenerateEngine
    from common.loader import load_model
    from common.requests import Request, SamplingParams
    from common.bench.workloads import model_token_range, random_token_ids

    loaded = load_model(a.model, device=a.device, dtype=a.dtype)
    rng = random.Random(a.seed)
    vocab = loaded.model.lm_head_weight.shape[0]
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts += [random_token_ids(rng, rng.randint(16, 200), *model_token_range(vocab))
                for _ in range(a.random_prompts)]
    requests = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=a.max_new_tokens)) for p in prompts]
    hf = HFGenerateEngine(loaded, max_batch_size=1)  # one prompt at a time: no padding in the reference
    t0 = time.perf_counter()
    reference = [c.token_ids for c in hf.generate(requests)]
    print(f"reference: transformers generate, {len(prompts)} prompts one at a time ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    entries = {}
    for n in stages:
        package = registry.stage_package(n)
        module = importlib.import_module(package)
        engine = module.InferenceEngine(loaded, **accepted(module.InferenceEngine, {"max_batch_size": a.max_batch_size}))
        outputs = [c.token_ids for c in engine.generate(requests)]
        entries[registry.short_name(package)] = result = compare(outputs, reference, prompts, hf.model)
        print(f"{registry.short_name(package):28s} identical {result['identical']:2d}/{result['requests']}, "
              f"agreement {100 * result['agreement']:5.1f} %", flush=True)
    return {"kind": "parity", "model": loaded.name, "device": str(loaded.device),
            "dtype": str(loaded.dtype).replace("torch.", ""), "dtype_reason": loaded.dtype_reason, "config": vars(a),
            "reference": "transformers generate, greedy, one prompt at a time, same weights, dtype and device",
            "prompt_lengths": [len(p) for p in prompts], "reference_lengths": [len(r) for r in reference],
            "entries": entries}


def format_parity(r: dict) -> str:
    lines = [f"=== greedy parity with transformers: {r['model']} ({r['device']}, {r['dtype']}) ===",
             *dtype_lines(r),
             f"{len(r['prompt_lengths'])} prompts of {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens, "
             f"up to {r['config']['max_new_tokens']} new tokens each (EOS stops), batch {r['config']['max_batch_size']}",
             f"{'stage':28s} {'identical':>9s} {'first tok':>9s} {'agreement':>9s}  first differences (margin)"]
    for name, e in r["entries"].items():
        diffs = ", ".join(f"#{d['request']}@{d['first_difference']}"
                          + (f" ({d['reference_margin']:.3f})" if d["reference_margin"] is not None else "")
                          for d in e["differences"])
        lines.append(f"{name:28s} {e['identical']:>4d}/{e['requests']:<4d} {e['first_tokens_equal']:>4d}/{e['requests']:<4d}"
                     f" {100 * e['agreement']:8.1f}%  {diffs or '-'}")
    margins = [e["max_margin_at_difference"] for e in r["entries"].values() if e["max_margin_at_difference"] is not None]
    if margins:
        lines.append(f"Largest reference margin at a difference: {max(margins):.3f} "
                     f"(median of the stages' largest {statistics.median(margins):.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.max_new_tokens < 1 or a.max_batch_size < 1 or a.random_prompts < 0:
        raise ValueError("--max-new-tokens and --max-batch-size must be >= 1, --random-prompts >= 0")
    stages = stage_numbers(a.stages)  # before the reference runs: a typo costs no minutes
    torch.manual_seed(a.seed)
    result = measure(a, stages)
    from common.bench.results import print_and_write
    return print_and_write("parity", result, format_parity(result), a.json, argv)


if __name__ == "__main__":  # as `stagewise parity`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise parity"))
