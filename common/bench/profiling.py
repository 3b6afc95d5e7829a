"""What both profilers share (profile_decode.py, profile_prefill.py): ops in groups, their table, the stage's engine.

torch.profiler lists ops by name; a reader wants to know how much of a step went to the matmuls,
to attention, to the paged KV cache, to the collectives of tensor parallelism, and to everything
else. `GROUPS` names the ops of each, `op_table` turns a profile into rows of an op's own time and
calls per step (and on CUDA the GPU time of the kernels it launched), and the group fields and
report lines are what both commands write to their JSON and print.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
from typing import Any

from common.config import ModelConfig

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention",
                  "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
                  # CUDA's backends run under those as ops of their own, and launch the kernels:
                  # on the H200 `_cudnn_attention_forward` held all of attention's kernel time
                  "aten::_cudnn_attention_forward", "aten::_flash_attention_forward",
                  "aten::_efficient_attention_forward",
                  "aten::_softmax", "aten::bmm", "aten::baddbmm"),
    "kv_cache": ("aten::index_select", "aten::index_copy_", "aten::index_put_", "aten::index_fill_",
                 "aten::gather", "aten::scatter_"),
    # Tensor parallelism (stage 14): the collectives, with the time rank 0 waits in them for the others
    # (each wrapped in a span of its own, whose self time is the wait: parallel.py)
    "communication": ("tensor_parallel::all_reduce", "tensor_parallel::gather", "tensor_parallel::broadcast",
                      "c10d::allreduce_", "c10d::gather_", "c10d::broadcast_",
                      "nccl:all_reduce", "nccl:gather", "nccl:broadcast"),
}


GRAPH_KERNELS = "(kernels no op launched: CUDA graph replays)"


def group_of(op: str) -> str:
    return next((g for g, names in GROUPS.items() if op in names), "other")


def op_table(prof: Any, steps: int, kernels: bool = False) -> list[dict]:
    """Every op's own time per step (ms) and calls per step, largest first.

    With `kernels` (CUDA), each op also gets the GPU time of the kernels it launched itself
    (`kernel_ms_per_step`): an op's CPU time is then what it costs to launch, not to compute.
    Kernels that no op launched, those a CUDA graph's replay runs (stage 12 on), get a row of
    their own (`GRAPH_KERNELS`, group "other"), so the rows' kernel times add up to the GPU's."""
    rows, kernel_us = [], 0.0
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        device_us = device_us if device_us is not None else getattr(e, "self_cuda_time_total", 0.0)
        if e.self_cpu_time_total <= 0:  # the kernels' own rows: counted under the op that launched them
            kernel_us += device_us
            continue
        row = {"op": e.key, "group": group_of(e.key), "ms_per_step": e.self_cpu_time_total / 1000.0 / steps,
               "calls_per_step": e.count / steps}
        if kernels:
            row["kernel_ms_per_step"] = device_us / 1000.0 / steps
        rows.append(row)
    if kernels:
        launched_by_ops = sum(r["kernel_ms_per_step"] for r in rows)
        unclaimed = kernel_us / 1000.0 / steps - launched_by_ops
        if unclaimed > 1e-3 * max(launched_by_ops, 1e-3):  # more than rounding
            rows.append({"op": GRAPH_KERNELS, "group": "other", "ms_per_step": 0.0, "calls_per_step": 0.0,
                         "kernel_ms_per_step": unclaimed})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def stage_class(a: argparse.Namespace) -> tuple[str, Any, ModelConfig]:
    """(stage package, its InferenceEngine class, the model's config), read before any weight is:
    a flag that cannot work with them fails in a second, not after the model has loaded."""
    from common.loader import model_dir
    from common.stages import resolve_stage

    package = resolve_stage(a.stage)
    return package, importlib.import_module(package).InferenceEngine, ModelConfig.from_pretrained(model_dir(a.model))


def stage_engine(a: argparse.Namespace, engine_class: Any, knobs: dict) -> tuple[Any, Any]:
    """(loaded model, the stage's offline InferenceEngine, from `stage_class`, with those of `knobs` it takes)."""
    from common.bench.knobs import accepted
    from common.loader import load_model

    loaded = load_model(a.model, device=a.device, dtype=a.dtype)
    return loaded, engine_class(loaded, **accepted(engine_class, knobs))


def has_knob(engine_class: Any, name: str) -> bool:
    return name in inspect.signature(engine_class).parameters


def result_head(kind: str, package: str, loaded: Any, a: argparse.Namespace) -> dict:
    """The fields a profile's result opens with: what ran, on which model, device and dtype, and its flags."""
    return {"kind": kind, "stage": package.rsplit(".", 1)[-1], "model": loaded.name, "device": str(loaded.device),
            "dtype": str(loaded.dtype).replace("torch.", ""), "dtype_reason": loaded.dtype_reason,
            "config": vars(a)}


def by_group(ops: list[dict], key: str = "ms_per_step") -> dict[str, float]:
    """The op rows' `key` summed per group (matmul, attention, kv_cache, communication, other)."""
    return {g: sum(r[key] for r in ops if r["group"] == g) for g in [*GROUPS, "other"]}


def group_fields(ops: list[dict]) -> dict:
    """The profiled total (ms) and every group's ms and share of it, as the JSON keeps them."""
    total = sum(r["ms_per_step"] for r in ops)
    groups = by_group(ops)
    return {"profiled_ms": total, "groups_ms_profiled": groups,
            "groups_share": {g: v / total if total else 0.0 for g, v in groups.items()}}


def graph_replays(ops: list[dict]) -> bool:
    """Did the profiled steps replay CUDA graphs? Their kernels then belong to no op (the
    `GRAPH_KERNELS` row holds them), so the groups cannot say what the matmuls or attention took."""
    return any(r["op"] == GRAPH_KERNELS and r.get("kernel_ms_per_step", 0.0) > 0 for r in ops)


def kernel_fields(ops: list[dict]) -> dict:
    """A CUDA profile's GPU time: every op's kernels summed, in all and per group."""
    return {"kernel_ms_per_step": sum(r["kernel_ms_per_step"] for r in ops),
            "groups_kernel_ms": by_group(ops, "kernel_ms_per_step")}


def report_lines(r: dict, top: int, per: str) -> list[str]:
    """The groups, then the `top` ops, of a profile result (`per`: "step", "prefill", ...)."""
    kernels = "kernel_ms_per_step" in r  # a CUDA profile: every op row has its kernels' time too
    lines = [f"  {g:13s} {ms:9.2f} ms  {100 * r['groups_share'][g]:5.1f} %" for g, ms in r["groups_ms_profiled"].items()]
    lines.append(f"{'op':52s} {'group':13s} {'ms/' + per:>12s} {'calls/' + per:>13s}" + (f" {'kernel ms':>9s}" if kernels else ""))
    graph_rows = [row for row in r["ops"][top:] if row["op"] == GRAPH_KERNELS]  # no launch time, yet the GPU's most
    for row in r["ops"][:top] + graph_rows:
        lines.append(f"{row['op'][:52]:52s} {row['group']:13s} {row['ms_per_step']:12.2f} {row['calls_per_step']:13.1f}"
                     + (f" {row['kernel_ms_per_step']:9.2f}" if kernels else ""))
    return lines
