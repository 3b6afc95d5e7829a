"""The engines' and managers' knobs: their flags, and which constructor takes which.

One definition for the stage benches (and their worker processes), `stagewise serve` and the
tools built on them, so `--block-size` means the same thing everywhere. Stages differ in what
they take (`--block-size` reaches stage 03 on, `--max-num-batched-tokens` stage 11 on), so every
knob is offered only to a constructor whose signature names it (`accepted`), and the ones a
stage takes nowhere are named (`knobs_not_taken`), never silently dropped.

- `add_engine_knob_args` and `engine_knobs`: the `InferenceEngine` knobs, to flags and back;
- `add_manager_args`, `manager_knobs`, `check_manager_flags`: the `SchedulerManager`'s own;
- `check_prefix_cache_flags`: the two ways to switch the prefix cache, not both at once.
"""
from __future__ import annotations

import argparse
import inspect
from types import ModuleType
from typing import Any

ENGINE_KNOBS = ("block_size", "kv_cache_max_concurrency", "num_kv_blocks",
                "prefix_cache_max_entries", "prefill_max_batch_size", "max_num_batched_tokens",
                "max_cudagraph_capture_size", "tensor_parallel_size")
# Two stages' ways to switch the prefix cache: stages 05-09 count whole-prompt entries, the
# block-level cache of stage 10+ is on or off (vLLM's name). `--no-prefix-cache` sets both.
PREFIX_CACHE_KNOBS = ("prefix_cache_max_entries", "enable_prefix_caching")
QUEUE_QUIET_MS = 5.0  # the managers' default quiet window (another, without a queue delay, is refused)


def add_enforce_eager_arg(g: argparse._ActionsContainer) -> None:
    """Three ways, as the engines of stages 12+ take it: unset (None: graphs on CUDA, eager on a
    CPU), --enforce-eager (True) or --no-enforce-eager (False: the padded path on a CPU too)."""
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="stage 12+: no CUDA graphs, every step eager (vLLM's flag; the default on a CPU). "
                        "--no-enforce-eager runs the graphs' padded path on a CPU too")


def add_engine_knob_args(g: argparse._ArgumentGroup) -> None:
    """The stages' engine knobs as flags (the benches and `stagewise serve`); `engine_knobs`
    reads them back, and each is passed only to stages whose constructor takes it."""
    g.add_argument("--max-batch-size", type=int, default=8)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-max-concurrency", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--prefix-cache-max-entries", type=int, default=None)
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="prefix_cache_max_entries=0 (stages 05-09; a stage's BENCH or a preset saying so gives "
                        "way to a typed --prefix-cache-max-entries), enable_prefix_caching=False (10+)")
    g.add_argument("--prefill-max-batch-size", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="stage 11+: tokens per step (chunked prefill)")
    add_enforce_eager_arg(g)
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="stage 12+: the largest decode batch captured as a CUDA graph (default: the max batch size, at most 512, as vLLM)")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="stage 14: ranks the model is split across, started by the engine (default 1)")


def add_manager_args(g: argparse._ArgumentGroup) -> None:
    """The SchedulerManager's own knobs as flags (the benches and `stagewise serve`); see `manager_knobs`."""
    g.add_argument("--tokenize-workers", type=int, default=0, help="manager tokenizer threads (0 = add_request's caller tokenizes)")
    g.add_argument("--stream-interval", type=int, default=1, help="flush the stream every N tokens")
    g.add_argument("--max-queue-delay-ms", type=float, default=0.0,
                   help="idle manager: wait up to this long for the rest of a burst before prefilling (0: off)")
    g.add_argument("--queue-quiet-ms", type=float, default=QUEUE_QUIET_MS,
                   help="with --max-queue-delay-ms: admit once no request has arrived for this long")


def check_manager_flags(args: argparse.Namespace) -> None:
    """A quiet window belongs to the queue delay: given alone, it would change nothing, silently.
    (Its default is spelled in every command rebuilt from a result: only another value is refused.)"""
    if args.queue_quiet_ms != QUEUE_QUIET_MS and not args.max_queue_delay_ms:
        raise ValueError("--queue-quiet-ms: only with --max-queue-delay-ms > 0 (the quiet window ends the "
                         "wait that flag starts; without it there is no wait)")


def manager_knobs(args: argparse.Namespace) -> dict:
    """SchedulerManager keyword arguments from the flags; pass them through `accepted`, since
    earlier stages' managers take fewer."""
    return {"max_batch_size": args.max_batch_size, "stream_interval": args.stream_interval,
            "tokenize_workers": args.tokenize_workers, "prefill_max_batch_size": args.prefill_max_batch_size,
            "max_queue_delay_ms": args.max_queue_delay_ms, "queue_quiet_ms": args.queue_quiet_ms}



def check_prefix_cache_flags(no_prefix_cache: bool, max_entries: int | None) -> None:
    """--no-prefix-cache and a cache size, both asked for: one would be dropped unseen (a stage
    bench checks what was typed, `stagewise serve`, which has no BENCH, what it was given)."""
    if no_prefix_cache and max_entries:
        raise ValueError("--prefix-cache-max-entries: cannot go with --no-prefix-cache; choose one")


def accepted(callable_: Any, knobs: dict) -> dict:
    """The knobs (not None) that `callable_` names in its signature: `--block-size` reaches
    stage 03+ and is simply not offered to stage 02, whose constructor has no such parameter."""
    try:
        params = inspect.signature(callable_).parameters
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: v for k, v in knobs.items() if v is not None and k in params and params[k].kind in kinds}


def knobs_not_taken(module: ModuleType, args: argparse.Namespace) -> list[str]:
    """The engine knobs set that neither the stage's engine nor its SchedulerManager takes (the
    manager takes prefill_max_batch_size, say). `--no-prefix-cache` reached the stage if it took
    either of its two knobs; where it took neither, it is named once."""
    knobs = engine_knobs(args)
    taken = accepted(module.InferenceEngine, knobs)
    ignored = sorted(k for k, v in knobs.items() if v is not None and k not in taken)
    manager = getattr(module, "SchedulerManager", None)
    if manager is not None:
        ignored = [k for k in ignored if k not in accepted(manager, knobs)]
    took_cache_knob = any(k in taken for k in PREFIX_CACHE_KNOBS)
    explicit = {"prefix_cache_max_entries"} if args.prefix_cache_max_entries is not None else set()
    return [k for k in ignored if k not in PREFIX_CACHE_KNOBS or k in explicit
            or (not took_cache_knob and k == "prefix_cache_max_entries")]


def engine_knobs(args: argparse.Namespace) -> dict:
    knobs = {k: getattr(args, k) for k in ENGINE_KNOBS}
    knobs["enforce_eager"] = getattr(args, "enforce_eager", None)  # offered only when asked for, either way
    if args.no_prefix_cache:  # a size given too (over a BENCH's or preset's "off") wins where the cache has one
        if knobs["prefix_cache_max_entries"] is None:
            knobs["prefix_cache_max_entries"] = 0
        knobs["enable_prefix_caching"] = False
    return knobs
