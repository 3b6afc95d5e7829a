"""The benchmark's flags, in one place: the stage benches and their worker processes, the
ladder, `stagewise bench-serve`, `serve` and `serve-overhead` all read them from here, so one
workload flag means the same thing everywhere (the engines' and managers' knobs: `knobs.py`).

- `WORKLOAD_FLAGS` and `workload_from_args`: the workload (`common.bench.workloads`) from the flags;
- `add_streaming_args`: how requests are submitted, with the `SchedulerManager`'s knobs;
- `build_parser` and `parse_bench_args`: a stage bench's flags, with its `BENCH` (or a
  `--preset`) as defaults, a choice typed in place of the defaults' own (a kind of prompt, a
  prefix cache size, a KV pool size), and `check_args`; `offline_unused`: the streaming flags an
  offline run leaves unused;
- `output_file` and `output_dir`: the argparse types of every `--json` and `--out`.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from types import ModuleType

from common.bench.knobs import (add_engine_knob_args, add_manager_args, check_manager_flags,
                                check_prefix_cache_flags)
from common.bench.workloads import build_workload
from common.commands import add_model_args


def _check_writable(path: Path, want_dir: bool) -> None:
    """ArgumentTypeError unless this user could write `path`, or make it: checked when the flags are
    read, so a typo in a folder fails at once, not after a run of many minutes. Checked by opening
    the file for appending (nothing written), or by making a temporary file in the folder that would
    hold it, as `os.access` says yes to root everywhere, /proc included."""
    path = Path(os.path.abspath(path))
    if path.exists() and path.is_dir() != want_dir:
        raise argparse.ArgumentTypeError(f"{path} is {'not ' if want_dir else ''}a directory")
    try:
        if path.exists() and not want_dir:  # /dev/null and a file to overwrite: its folder is not written
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))  # a FIFO with no reader: refused, not a hang
            return
        folder = path if want_dir else path.parent
        while not folder.exists():  # the writers make missing folders: the nearest one that exists must take them
            folder = folder.parent
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {exc.strerror}") from None


def output_file(text: str) -> str:
    """The argparse type of `--json PATH`: a file this user can write (see _check_writable)."""
    _check_writable(Path(text), want_dir=False)
    return text


def output_dir(text: str) -> str:
    """The argparse type of `--out DIR`: a folder this user can write or make (see _check_writable)."""
    _check_writable(Path(text), want_dir=True)
    return text


# Named workloads (`--preset NAME`): a preset takes the place of the stage's own BENCH (a flag it
# does not set keeps the bench's plain default, not the stage's); typed flags still override.
# "post-052" is post 052's shape (stage 09's BENCH; a test keeps the two equal): `make bench`
# runs it on the newest stage, whatever that stage's own workload, so its numbers compare.
PRESETS: dict[str, dict] = {
    "post-052": {
        "mode": "streaming",
        "prompt": "Hello",
        "pretok": True,
        "stream_interval": 8,
        "num_requests": 64,
        "submit_interval_ms": 20.0,
        "submit_schedule": "absolute",
        "max_new_tokens": 128,
        "max_batch_size": 64,
        "prefill_max_batch_size": 64,
        "no_stop_on_eos": True,
        "no_prefix_cache": True,
        "warmup_runs": 1,
        "repeat_runs": 2,
    },
}


# The workload flags (`workload_from_args` reads them): the benches, the ladder's workers and
# `stagewise bench-serve`, which replays the same workloads over HTTP, all take exactly these.
WORKLOAD_FLAGS: list[tuple[str, dict]] = [
    ("--prompt", {"default": "Hello", "help": "the text of every prompt; typed, it replaces a stage's chat or random ones"}),
    ("--unique-prompts", {"action": "store_true", "help": "append ' #i' to each prompt text"}),
    ("--prompt-len-min", {"type": int, "default": None, "help": "random prompt token ids, min length"}),
    ("--prompt-len-max", {"type": int, "default": None, "help": "random prompt token ids, max length"}),
    ("--chat-prompts", {"action": "store_true",
                        "help": "a different short question per request, in the model's chat template (bench-serve: "
                                "with --endpoint chat; to /v1/completions they go as plain text); they stop at EOS "
                                "unless --no-stop-on-eos is given (on a stage's bench, in place of the stage's or "
                                "the preset's own prompts and EOS setting)"}),
    ("--num-requests", {"type": int, "default": 32}),
    ("--max-new-tokens", {"type": int, "default": 16}),
    ("--no-stop-on-eos", {"action": "store_true", "help": "always generate max-new-tokens (HTTP: sends ignore_eos)"}),
    ("--long-every", {"type": int, "default": None, "help": "request i wants --long-max-new-tokens if i %% N == 0"}),
    ("--long-max-new-tokens", {"type": int, "default": None, "help": "default 10x --max-new-tokens"}),
    ("--shared-prefix-len", {"type": int, "default": None, "help": "random token prefix shared by all prompts"}),
    ("--repeat-prompts", {"type": int, "default": None, "help": "each distinct prompt sent K times in a row"}),
    ("--long-prompts", {"type": int, "default": None,
                        "help": "K late requests after the others, each --long-prompt-len random token ids"}),
    ("--long-prompt-len", {"type": int, "default": 2000, "help": "tokens in each late long prompt"}),
    ("--long-prompt-interval-ms", {"type": float, "default": 2000.0,
                                   "help": "the first late long prompt arrives after T ms, then one every T ms"}),
]


def add_streaming_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("streaming (stages with a SchedulerManager)")
    g.add_argument("--pretok", action="store_true", help="submit prompt_token_ids (tokenize before submitting)")
    g.add_argument("--pretok-base-token-ids", action="store_true",
                   help="with --pretok: tokenize the prompt before --unique-prompts' suffix (same ids, different text)")
    add_manager_args(g)
    g.add_argument("--submit-interval-ms", type=float, default=0.0, help="time between submissions")
    g.add_argument("--submit-schedule", choices=["absolute", "relative"], default="absolute")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="give up on a run after this long")


# What only a streaming run reads (its SchedulerManager, its submitter, its stream): an offline
# run, one generate() over every request, has none of them.
STREAMING_FLAGS = ("tokenize_workers", "stream_interval", "max_queue_delay_ms", "queue_quiet_ms",
                  "prefill_max_batch_size", "submit_interval_ms", "submit_schedule", "request_timeout_s")


def offline_unused(args: argparse.Namespace) -> list[str]:
    """The streaming-only flags set away from their plain defaults (typed, or by the stage's BENCH
    or the preset): an offline run leaves them unused, and its report says so."""
    plain = build_parser("bench")
    return ["--" + k.replace("_", "-") for k in STREAMING_FLAGS if getattr(args, k) != plain.get_default(k)]


def build_parser(prog: str, defaults: dict | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark a stage (see docs: method).")
    g = p.add_argument_group("model")
    add_model_args(g)
    g.add_argument("--seed", type=int, default=0, help="workload RNG and torch seed")
    g = p.add_argument_group("workload")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named workload instead of the stage's BENCH (flags still override); "
                        "post-052: post 052's shape, what `make bench` runs")
    for flag, kwargs in WORKLOAD_FLAGS:
        g.add_argument(flag, **kwargs)
    g = p.add_argument_group("engine knobs (passed only to engines whose constructor takes them)")
    add_engine_knob_args(g)
    # A fresh engine per run (the model stays loaded): caches start cold, as in the posts' one run
    # per process; otherwise a warmup run would turn every timed request into a prefix-cache hit.
    g.add_argument("--reuse-engine", dest="fresh_engine", action="store_false",
                   help="keep one engine across warmup and repeats (its caches stay warm)")
    g = p.add_argument_group("method")
    g.add_argument("--mode", choices=["offline", "streaming"], default=None,
                   help="offline generate() or streaming SchedulerManager (default: streaming when the stage has one)")
    g.add_argument("--warmup-runs", type=int, default=1)
    g.add_argument("--repeat-runs", type=int, default=3)
    g.add_argument("--compare", action="store_true", help="also run the previous stage, same workload")
    g.add_argument("--baseline", choices=["hf"], default=None, help="also run transformers generate")
    g.add_argument("--same-process", action="store_true",
                   help="run compared engines in this one process, alternating (default: each in a fresh process)")
    g.add_argument("--rounds", type=int, default=1,
                   help="with --compare/--baseline: fresh processes per engine, interleaved (A B, A B, ...), "
                        "their runs pooled, so a slow minute of the machine falls on both")
    g.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write the result as JSON")
    add_streaming_args(p)
    if defaults:
        p.set_defaults(**defaults)
    return p


def bench_defaults(module: ModuleType, parser: argparse.ArgumentParser | None = None) -> dict:
    """A stage's `BENCH` dict turned into argparse defaults (CLI flags still override)."""
    return as_defaults(getattr(module, "BENCH", {}) or {}, parser, f"BENCH of {module.__name__}")


def as_defaults(bench: dict, parser: argparse.ArgumentParser | None, where: str) -> dict:
    """A BENCH-style dict (or a preset) as argparse dests; unknown keys are an error naming `where`."""
    bench = dict(bench)
    if "prompt_len_range" in bench:
        rng = bench.pop("prompt_len_range")
        bench["prompt_len_min"], bench["prompt_len_max"] = (None, None) if rng is None else rng
    if "stop_on_eos" in bench:
        bench["no_stop_on_eos"] = not bench.pop("stop_on_eos")
    known = {a.dest for a in (parser or build_parser("bench"))._actions}
    unknown = sorted(set(bench) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    return bench


def parse_bench_args(module: ModuleType, argv: list[str], prog: str | None = None) -> argparse.Namespace:
    """The flags of a stage's bench: its BENCH (or `--preset`'s workload instead) as defaults,
    then what was typed. Where the defaults hold a choice the typed flag makes another way, the
    typed one replaces it: a kind of prompt (`prompt_kind_typed`), one of the two ways to size the
    KV pool (and a prefix cache size over "off", in `engine_knobs`, on each stage whose cache has
    one). The bench and its worker processes both parse here, so they build the same workload."""
    prog = prog or f"python -m {module.__name__}.bench"
    parser = build_parser(prog)
    parser.set_defaults(**bench_defaults(module, parser))
    args = parser.parse_args(argv)
    if args.preset is not None:  # a second pass on a parser without the stage's BENCH
        parser = build_parser(prog)
        parser.set_defaults(**as_defaults(PRESETS[args.preset], parser, f"preset {args.preset!r}"))
        args = parser.parse_args(argv)
    typed_names = typed_flags(build_parser(prog), argv)  # no BENCH, no preset
    prompt_kind_typed(args, typed_names)
    check_prefix_cache_flags("no_prefix_cache" in typed_names,  # a BENCH's or preset's "off" gives way (engine_knobs)
                             args.prefix_cache_max_entries if "prefix_cache_max_entries" in typed_names else None)
    pool_sizes = {"num_kv_blocks", "kv_cache_max_concurrency"}  # two ways to size the KV pool: a typed one wins
    if len(typed_names & pool_sizes) == 1:
        setattr(args, (pool_sizes - typed_names).pop(), None)  # stage 13's BENCH has num_kv_blocks=280
    return args


def typed_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The dests the command line itself set, not a default (nor a BENCH's or a preset's):
    `parser`, a fresh one, parses `argv` again with every default suppressed."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def check_prompt_kind(chat: bool, lengths: bool, shared_prefix: bool, text: bool = False) -> None:
    """One kind of prompt at a time: a text (`--prompt`), chat questions or random token prompts
    (`--prompt-len-*`); chat questions share no random prefix either. Given two, one would be
    dropped unseen, so each pair is a ValueError naming both flags."""
    if chat and lengths:
        raise ValueError("--chat-prompts: cannot go with --prompt-len-min/--prompt-len-max (random token prompts); "
                         "choose one")
    if chat and shared_prefix:
        raise ValueError("--chat-prompts: cannot go with --shared-prefix-len (the questions share no prefix); "
                         "choose one")
    if text and (chat or lengths):
        other = "--chat-prompts" if chat else "--prompt-len-min/--prompt-len-max (random token prompts)"
        raise ValueError(f"--prompt: cannot go with {other}; choose one")


def prompt_kind_typed(args: argparse.Namespace, typed: set[str]) -> None:
    """A kind of prompt typed on the command line replaces the stage's (or the preset's) own:
    `--chat-prompts` on stage 12, whose BENCH asks for random 16-token prompts with EOS ignored,
    runs chat questions that stop at EOS (unless `--no-stop-on-eos` is typed too), as stage 13's
    workload does, and on stage 10 without its shared prefix; `--prompt-len-min/max` on stage 13
    runs random prompts (that stop at EOS, as the stage's own did: only chat questions bring an
    EOS setting of their own); a typed `--prompt`, even the default's "Hello", runs that text.
    Two kinds typed together are an error naming them."""
    chat, lengths, text = "chat_prompts" in typed, bool(typed & {"prompt_len_min", "prompt_len_max"}), "prompt" in typed
    check_prompt_kind(chat, lengths, "shared_prefix_len" in typed, text)
    if chat:
        args.prompt_len_min = args.prompt_len_max = args.shared_prefix_len = None
        if "no_stop_on_eos" not in typed:
            args.no_stop_on_eos = False
    elif lengths:
        args.chat_prompts = False
    elif text:
        args.chat_prompts, args.prompt_len_min, args.prompt_len_max = False, None, None


def check_workload_flags(args: argparse.Namespace) -> None:
    """What build_workload would refuse (naming its arguments) once a tokenizer is loaded, named
    here by flag, before any weights load."""
    for name in ("prompt_len_min", "prompt_len_max"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if (args.prompt_len_min is None) != (args.prompt_len_max is None):
        args.prompt_len_min = args.prompt_len_max = args.prompt_len_min or args.prompt_len_max
    if args.shared_prefix_len and args.prompt_len_min is not None and args.prompt_len_min <= args.shared_prefix_len:
        raise ValueError(f"--prompt-len-min/--prompt-len-max: a random prompt's length counts the shared prefix "
                         f"(--shared-prefix-len {args.shared_prefix_len}), so it must exceed it, "
                         f"got {args.prompt_len_min}")
    if args.long_max_new_tokens is not None and args.long_every is None:
        raise ValueError("--long-max-new-tokens: only used with --long-every (which requests are the long ones)")
    if not args.long_prompts:  # their defaults are spelled in every rebuilt command: only another value is refused
        plain = build_parser("bench")
        for name in ("long_prompt_len", "long_prompt_interval_ms"):
            if getattr(args, name) != plain.get_default(name):
                raise ValueError(f"--{name.replace('_', '-')}: only used with --long-prompts (how many late prompts)")


def check_args(args: argparse.Namespace) -> None:
    check_workload_flags(args)
    if args.num_kv_blocks is not None and args.kv_cache_max_concurrency is not None:  # the engine would say so, loaded
        raise ValueError("--num-kv-blocks: cannot go with --kv-cache-max-concurrency (two ways to size the pool); "
                         "choose one")
    for name in ("num_requests", "max_new_tokens", "max_batch_size", "repeat_runs", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.warmup_runs < 0:
        raise ValueError("--warmup-runs: must be >= 0")
    if not 0 <= args.submit_interval_ms < math.inf:  # NaN fails too
        raise ValueError(f"--submit-interval-ms: must be a finite number >= 0, got {args.submit_interval_ms}")
    if not 0 < args.request_timeout_s < math.inf:
        raise ValueError(f"--request-timeout-s: must be a finite number > 0, got {args.request_timeout_s}")
    check_manager_flags(args)
    if args.rounds > 1 and (args.same_process or not (args.compare or args.baseline)):
        raise ValueError("--rounds: fresh processes per compared engine; it needs --compare or --baseline "
                         "and cannot go with --same-process")


def workload_from_args(tokenizer, args: argparse.Namespace):
    rng = None if args.prompt_len_min is None else (args.prompt_len_min, args.prompt_len_max)
    return build_workload(
        tokenizer, prompt=args.prompt, num_requests=args.num_requests, unique_prompts=args.unique_prompts,
        prompt_len_range=rng, max_new_tokens=args.max_new_tokens, long_every=args.long_every,
        long_max_new_tokens=args.long_max_new_tokens, shared_prefix_len=args.shared_prefix_len,
        repeat_prompts=args.repeat_prompts, stop_on_eos=not args.no_stop_on_eos, seed=args.seed,
        pretok=args.pretok, pretok_base_token_ids=args.pretok_base_token_ids, long_prompts=args.long_prompts,
        long_prompt_len=args.long_prompt_len, long_prompt_interval_ms=args.long_prompt_interval_ms,
        chat_prompts=args.chat_prompts)


def describe_workload(args: argparse.Namespace) -> str:
    if args.prompt_len_min is not None:
        text = f"random prompts {args.prompt_len_min}-{args.prompt_len_max} tokens"
    elif args.chat_prompts:
        text = "a different short chat question each"
    else:
        text = f"prompt {args.prompt!r}" + (" + ' #i'" if args.unique_prompts else "")
    if args.shared_prefix_len:
        text += f", shared prefix {args.shared_prefix_len} tokens"
    if args.repeat_prompts:
        text += f", each prompt x{args.repeat_prompts}"
    text += f", {args.max_new_tokens} new tokens"
    if args.long_every:
        text += f" ({args.long_max_new_tokens or 10 * args.max_new_tokens} for 1 in {args.long_every})"
    text += ", EOS ignored" if args.no_stop_on_eos else ", stop on EOS"
    if args.long_prompts:
        text += (f"; then {args.long_prompts} late prompts of {args.long_prompt_len} random tokens, "
                 f"one every {args.long_prompt_interval_ms:g} ms")
    return text


