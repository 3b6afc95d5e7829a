"""Figures inside a sentence, from the committed bench JSON: `bench-value`, `bench-ratio`,
`bench-range`, `bench-median` and `bench-count`, for the stagewise hook.

Why separate from stagewise_results.py: that module turns a whole result into tables (with the
command from stagewise_commands.py under them); this one reads single quantities out of results (a dotted key, '*' over a list's items,
or '=' arithmetic over keys) and prints them as a page's prose does, so that no figure in a
sentence is ever typed by hand.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import shlex
import statistics
from pathlib import Path
from typing import Any

from stagewise_results import DocsError, _number, load_result, lookup


UNITS = {"KiB": 1 / 1024, "MiB": 1 / 2**20, "%": 100.0}  # bench-value's optional last word: shown in it
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}
MINUS = "\u2212"  # how a negative figure is shown: a minus sign, not a hyphen, as the pages' prose writes it
_KEY_RE = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.\w+)*")  # a dotted key in an '=' expression: results.0.x
_STARRED_KEY_RE = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.(?:\w+|\*))*")  # ... or with a '*' for each item


def _words(directive: str, args: str) -> list[str]:
    """A directive's arguments, split as a shell would: a key with a space in it is quoted."""
    try:
        return shlex.split(args)
    except ValueError as e:
        raise DocsError(f"{directive}: {e} in {args!r}") from None


def _quantity(data: Any, key: str, path: str) -> float:
    """A dotted key's number, or with a leading '=' arithmetic (+ - * /, parentheses, numbers)
    over such keys: '=(profiled_step_ms - groups_ms_profiled.matmul) / floor_matmul_ms_profiled'.
    Either must be finite: a page never shows 'nan' or 'inf'."""
    value = _evaluate(data, key, path) if key.startswith("=") else _number(data, key, path)
    if not math.isfinite(value):
        raise DocsError(f"{path}: {key!r} is {value}")
    return value + 0.0  # -0.0 shows as 0


def _evaluate(data: Any, key: str, path: str) -> float:
    keys: list[str] = []

    def name(m: re.Match) -> str:  # each key becomes a plain name for Python's parser: _k0, _k1, ...
        keys.append(m.group(0))
        return f"_k{len(keys) - 1}"

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id.startswith("_k"):
            return _number(data, keys[int(node.id[2:])], path)
        raise DocsError(f"{path}: {key!r}: only + - * / and parentheses over dotted keys and numbers")
    try:
        tree = ast.parse(_KEY_RE.sub(name, key[1:]), mode="eval")
    except SyntaxError:
        raise DocsError(f"{path}: {key!r} is not an expression over dotted keys") from None
    try:
        return ev(tree.body)
    except ZeroDivisionError:
        raise DocsError(f"{path}: {key!r} divides by zero") from None


def render_bench_value(root: Path, args: str) -> str:
    parts = _words("bench-value", args)
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in UNITS):
        raise DocsError(f"bench-value: expected 'PATH KEY [{'|'.join(UNITS)}]', got {args!r}")
    data = load_result(root, parts[0])
    if data is None:
        return "*pending*"
    unit = parts[2] if len(parts) == 3 else None
    return _figures([_quantity(data, parts[1], parts[0])], unit)[0] + (f" {unit}" if unit else "")


def _quantities(data: Any, key: str, path: str) -> list[float]:
    """A key's number, or with a '*' for a list, one for each item: 'overhead.pairs.*.ttft_ms', or
    a list of numbers' own items, 'floor_samples_ms.*'; in arithmetic every '*' takes the same
    item: '=pairs.*.a - pairs.*.b', '=samples.split.* / samples.one.*'."""
    if key.startswith("="):
        return _starred_expression(data, key, path)
    m = re.search(r"([A-Za-z_]\w*(?:\.\w+)*)\.\*\.", key)
    if m is None and key.endswith(".*"):
        return [_quantity(data, f"{key[:-2]}.{i}", path) for i in range(len(_star_list(data, key[:-2], path)))]
    if m is None:
        return [_quantity(data, key, path)]
    head = m.group(1)
    items = _star_list(data, head, path)
    tail = key[m.end():]  # a plain key: each item's own lists are walked in turn
    return [v for i in range(len(items)) for v in _quantities(data, f"{head}.{i}.{tail}", path)]


def _star_list(data: Any, head: str, path: str) -> list:
    """The non-empty list a '*' after `head` runs over."""
    items = lookup(data, head, path)
    if not isinstance(items, list) or not items:
        raise DocsError(f"{path}: {head!r} is not a list to take '*' over")
    return items


def _starred_expression(data: Any, key: str, path: str) -> list[float]:
    """An '=' expression whose keys may each hold one '*': every '*' takes the same item, so the
    lists must be as long as each other ('=pairs.*.a - pairs.*.b', '=split.* / one.*')."""
    starred = [k for k in _STARRED_KEY_RE.findall(key[1:]) if ".*" in k]
    if not starred:
        return [_quantity(data, key, path)]
    sizes = set()
    for k in starred:
        if k.count(".*") > 1:
            raise DocsError(f"{path}: {key!r}: one '*' a key in an expression ({k!r} has more)")
        sizes.add(len(_star_list(data, k[:k.index(".*")], path)))
    if len(sizes) > 1:
        raise DocsError(f"{path}: {key!r}: its '*' lists differ in length ({sorted(sizes)})")
    return [_quantity(data, "=" + _STARRED_KEY_RE.sub(lambda m: m.group(0).replace(".*", f".{i}"), key[1:]), path)
            for i in range(sizes.pop())]


def _values_of(directive: str, root: Path, args: str) -> tuple[list[float] | None, str | None]:
    """`PATH KEY [PATH KEY ...] [UNIT]`: every value named (a '*' key gives one per list item),
    and the unit; None for the values while a file is not committed yet."""
    parts = _words(directive, args)
    unit = parts.pop() if len(parts) % 2 else None
    if len(parts) < 2 or (unit is not None and unit not in UNITS):
        raise DocsError(f"{directive}: expected 'PATH KEY [PATH KEY ...] [{'|'.join(UNITS)}]', got {args!r}")
    values: list[float] = []
    for path, key in zip(parts[::2], parts[1::2]):
        data = load_result(root, path)
        if data is None:
            return None, unit
        values += _quantities(data, key, path)
    return values, unit


def _figures(values: list[float], unit: str | None) -> list[str]:
    """Figures shown side by side, all alike: "0.94 to 1.00", not "0.94 to 1"."""
    if unit:
        return [f"{v * UNITS[unit]:.1f}".replace("-", MINUS) for v in values]
    digits = 0 if all(v.is_integer() for v in values) else 2  # a count (kernel launches a step) reads as one
    return [f"{v:.{digits}f}".replace("-", MINUS) for v in values]


def render_bench_range(root: Path, args: str) -> str:
    """'LOW to HIGH' of one quantity over several results, or over a list's items ('pairs.*.x')."""
    values, unit = _values_of("bench-range", root, args)
    if values is None:
        return "*pending*"
    low, high = _figures([min(values), max(values)], unit)
    return f"{low} to {high}" + (f" {unit}" if unit else "")


def render_bench_median(root: Path, args: str) -> str:
    """The median of the same: the middle of a run's pairs, say ('overhead.pairs.*.x')."""
    values, unit = _values_of("bench-median", root, args)
    if values is None:
        return "*pending*"
    return _figures([statistics.median(values)], unit)[0] + (f" {unit}" if unit else "")


def _finite(word: str) -> float | None:
    """The word as a finite number, or None."""
    try:
        value = float(word)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


_COMPARE = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}


def render_bench_count(root: Path, args: str) -> str:
    """'N of M': how many of a list's items (a '*' key) pass a test, against a number or against
    the median of another key's values ('PATH KEY > 10', 'PATH KEY < PATH2 KEY2'), so that a
    page's "7 of the 10 pairs" is counted from the file, never typed."""
    parts = _words("bench-count", args)
    if len(parts) not in (4, 5) or parts[2] not in _COMPARE or ".*." not in parts[1]:
        raise DocsError(f"bench-count: expected 'PATH KEY.*.X {'|'.join(_COMPARE)} (NUMBER | PATH KEY)', got {args!r}")
    limit = _finite(parts[3])  # checked before any file is read
    if len(parts) == 4 and limit is None:
        raise DocsError(f"bench-count: {parts[3]!r} is not a finite number (or give 'PATH KEY')")
    if len(parts) == 5 and limit is not None:
        raise DocsError(f"bench-count: a number limit takes no fifth word, got {args!r}")
    data = load_result(root, parts[0])
    if data is None:
        return "*pending*"
    values = _quantities(data, parts[1], parts[0])
    if limit is None:
        other = load_result(root, parts[3])
        if other is None:
            return "*pending*"
        limit = statistics.median(_quantities(other, parts[4], parts[3]))
    return f"{sum(_COMPARE[parts[2]](v, limit) for v in values)} of {len(values)}"


def render_bench_ratio(root: Path, args: str) -> str:
    parts = _words("bench-ratio", args)
    if len(parts) == 3:  # both keys in one file
        parts = [parts[0], parts[1], parts[0], parts[2]]
    if len(parts) != 4:
        raise DocsError(f"bench-ratio: expected 'PATH NUMERATOR_KEY DENOMINATOR_KEY' or "
                        f"'PATH NUMERATOR_KEY PATH DENOMINATOR_KEY', got {args!r}")
    num_data, den_data = load_result(root, parts[0]), load_result(root, parts[2])
    if num_data is None or den_data is None:
        return "*pending*"
    num, den = _quantity(num_data, parts[1], parts[0]), _quantity(den_data, parts[3], parts[2])
    return "—" if den == 0 else f"{num / den:.2f}×".replace("-", MINUS)
