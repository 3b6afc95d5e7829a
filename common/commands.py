"""What every command-line program of the project shares: the model flags, and how it ends on bad
input (one line, status 2).

The programs (`stagewise`, each stage's `python -m stages.<stage>` and its `.bench`) validate much
that argparse cannot see: a stage number, a model name, an engine knob. That validation raises
ValueError naming the field (the engine's own rule, for Python callers). At a terminal it should
read like argparse's own errors, `PROG: error: <field> ...` and exit status 2, not a traceback
with the field's name at the bottom of forty lines.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def run_command(main: Callable[[], Any], prog: str) -> int:
    """main()'s exit status (0 for anything but an int); a ValueError is printed as one line on
    stderr, and the status is 2."""
    try:
        status = main()
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


# --dtype of every command (common.loader.choose_dtype does the picking)
DTYPE_HELP = ("auto (bfloat16 where the hardware runs it natively: CUDA, a CPU with bf16 matmul units) | "
              "float32 | bfloat16 | float16; default: bfloat16 on CUDA, float32 on a CPU")


def add_sampling_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--do-sample and the knobs it turns on, as transformers' `generate` names them (`stagewise
    generate` and each stage's `python -m stages.<stage>`). Without --do-sample the output is greedy."""
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy, the argmax)")
    p.add_argument("--temperature", type=float, default=None, help="with --do-sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="with --do-sample (default 0: off)")
    p.add_argument("--top-p", type=float, default=None, help="with --do-sample (default 1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="with --do-sample: the request's own random stream")


def sampling_knobs(args: argparse.Namespace) -> dict:
    """`add_sampling_args`' flags as SamplingParams' keywords (those not typed keep its defaults).
    A knob typed without --do-sample is a ValueError naming it: the output would be greedy and the
    knob unused without a word (transformers' `generate` warns). A knob's "off" value asks for
    nothing and is allowed: `--temperature 0` (greedy's usual spelling), `--top-k 0`, `--top-p 1`."""
    typed = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "seed") if getattr(args, k) is not None}
    off = {"temperature": 0, "top_k": 0, "top_p": 1.0}  # the values that ask for no sampling
    unused = [k for k, v in typed.items() if off.get(k, object()) != v]
    if unused and not args.do_sample:
        raise ValueError(f"{unused[0]}: only used when sampling; add --do-sample (without it the output is greedy)")
    return {"do_sample": args.do_sample, **typed}


def add_model_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--model, --device and --dtype, the same in every program that loads a model (`stagewise`
    and its subcommands, each stage's `python -m stages.<stage>` and its bench)."""
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | gpt2-random | HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
