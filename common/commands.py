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


def add_model_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--model, --device and --dtype, the same in every program that loads a model (`stagewise`
    and its subcommands, each stage's `python -m stages.<stage>` and its bench)."""
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | gpt2-random | HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
