"""How every command-line program of the project ends on bad input: one line, status 2.

The programs (`stagewise`, each stage's `python -m stages.<stage>` and its `.bench`) validate much
that argparse cannot see: a stage number, a model name, an engine knob. That validation raises
ValueError naming the field (the engine's own rule, for Python callers). At a terminal it should
read like argparse's own errors, `PROG: error: <field> ...` and exit status 2, not a traceback
with the field's name at the bottom of forty lines.
"""
from __future__ import annotations

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
