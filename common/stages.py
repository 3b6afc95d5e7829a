"""The stage registry: the only place that knows every stage.

A stage never imports another stage (so each one reads on its own and `diff -ru` between two
neighbours stays honest). Everything that needs two stages at once -- `--compare`, the CLI,
the ladder -- goes through here instead.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

STAGES: dict[int, str] = {
    1: "stages.s01_naive_batching",
    2: "stages.s02_kv_cache",
    3: "stages.s03_paged_attention",
    4: "stages.s04_online_scheduler",
    5: "stages.s05_prefix_cache",
    6: "stages.s06_prefill_microbatching",
    7: "stages.s07_admission_knob",
    8: "stages.s08_token_id_cache_keys",
    9: "stages.s09_batched_worker_lookups",
    10: "stages.s10_block_prefix_cache",
    11: "stages.s11_chunked_prefill",
    12: "stages.s12_cuda_graphs",
    13: "stages.s13_preemption",
    14: "stages.s14_tensor_parallel",
}


def stage_package(n_or_name: int | str) -> str:
    """Resolve 2, "2", "02", "s02_kv_cache" or "stages.s02_kv_cache" to the package name."""
    if isinstance(n_or_name, int) or str(n_or_name).strip().isdigit():
        n = int(n_or_name)
        if n not in STAGES:
            raise ValueError(f"stage: no stage {n}; known: {sorted(STAGES)}")
        return STAGES[n]
    name = str(n_or_name).strip()
    for package in STAGES.values():
        if name in (package, short_name(package)):
            return package
    raise ValueError(f"stage: unknown stage {name!r}; known: {[short_name(p) for p in STAGES.values()]}")


def short_name(package: str) -> str:
    """"stages.s02_kv_cache" -> "s02_kv_cache" (the name used in reports and JSON)."""
    return package.rsplit(".", 1)[-1]


def stage_number(n_or_name: int | str) -> int:
    package = stage_package(n_or_name)
    return next(n for n, p in STAGES.items() if p == package)


def load_stage(n_or_name: int | str) -> ModuleType:
    """Import a stage package by number or name."""
    return importlib.import_module(stage_package(n_or_name))


def previous_stage(n_or_name: int | str) -> str | None:
    """The package of the stage before this one, or None for the first stage."""
    return STAGES.get(stage_number(n_or_name) - 1)


def available_stages() -> list[str]:
    """Packages that import right now (stages are written one after the other)."""
    found = []
    for package in STAGES.values():
        try:
            importlib.import_module(package)
        except ImportError:
            continue
        found.append(package)
    return found


def newest_available_stage(at_most: int | str | None = None) -> str:
    """The newest stage that imports, not newer than `at_most` (a number or name)."""
    limit = stage_number(at_most) if at_most is not None else max(STAGES)
    for package in reversed(available_stages()):
        if stage_number(package) <= limit:
            return package
    raise RuntimeError(f"stage: no stage up to {limit} imports; is the project installed?")


def summary_line(module: ModuleType) -> str:
    """First sentence of a stage's docstring: what it adds over the previous stage."""
    doc = (module.__doc__ or "").strip()
    first = doc.split("\n\n", 1)[0].replace("\n", " ")
    return first.split(". ", 1)[0].rstrip(".") + "." if first else ""


def streaming_stage(stage: str | int | None) -> str:
    """resolve_stage, for a command that drives a stage's SchedulerManager (serve, serve-compare,
    worker-probe): a stage without one, 01 to 03, is a ValueError naming it."""
    package = resolve_stage(stage)
    if not hasattr(importlib.import_module(package), "SchedulerManager"):
        raise ValueError(f"stage: {package} has no SchedulerManager; stage 4 or later has one")
    return package


def resolve_stage(stage: str | int | None) -> str:
    """The requested stage if it imports, else the newest one before it that does (with a note)."""
    wanted = stage_package(stage) if stage is not None else STAGES[max(STAGES)]
    try:
        importlib.import_module(wanted)
        return wanted
    except ImportError:
        found = newest_available_stage(at_most=wanted)
        print(f"note: {short_name(wanted)} is not available; using {short_name(found)}",
              file=sys.stderr)
        return found
