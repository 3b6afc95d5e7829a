"""mkdocs hook: turn `<!-- directive: ... -->` lines into content generated from the repo.

Why a hook: the docs must never drift from the code or the numbers. Diffs between stages are
computed from `stages/` at build time, result tables are rendered from the committed JSON under
`docs/results/`, so a page cannot show a diff or a number that the repository does not contain.

Block directives (alone on their line; the line's indentation is kept, so they work inside
admonitions and content tabs):

    <!-- stage-diff: s01_naive_batching s02_kv_cache -->     diff -ru of the *.py files; missing dir = build error
    <!-- stage-diff-if-present: A B -->                      same, or a "not built yet" note
    <!-- include: common/model.py::Attention -->              a file, class, function, method
                                                              (Class.method) or assignment, by name;
                                                              missing = build error
    <!-- include-if-present: stages/s03_x/engine.py -->      the same, or a "not built yet" note
    <!-- bench-results: docs/results/X.json [| command] -->   tables from a bench JSON, or a note
    <!-- bench-tabs: CPU docs/results/cpu/X.json | CUDA docs/results/cuda/X.json -->
                                                             a tab per committed result (the first always)
    <!-- ladder-chart[: docs/results/cpu/ladder.cpu.png] -->     the ladder image, or a note
    <!-- ladder-table[: docs/results/cpu/ladder.cpu.json] -->    the ladder table, or a note
    <!-- parity-table: docs/results/parity.X.json -->        `stagewise parity`'s table, or a note
    <!-- serve-pairs: docs/results/serve.X.json -->          `stagewise serve-overhead`'s pairs, or a note

Inline directives (anywhere in a line, e.g. a table cell):

    <!-- bench-value: docs/results/X.json ttft_ms.p99 -->              one number, 2 decimals
    <!-- bench-value: docs/results/X.json kv_bytes KiB -->             in KiB, MiB, or % (a share x 100)
    <!-- bench-ratio: docs/results/X.json compare.s06_x.ttft_ms.p99 ttft_ms.p99 -->   a / b as "2.17×"
    <!-- bench-ratio: docs/results/X.json KEY docs/results/Y.json KEY -->          the same across two files
    <!-- bench-range: docs/results/X.json KEY docs/results/Y.json KEY ... [%] -->  "LOW to HIGH" over results
    <!-- bench-range: docs/results/X.json overhead.pairs.*.ttft_ms -->              ... over a list's items
    <!-- bench-range: docs/results/X.json floor_samples_ms.* -->                    ... a list of numbers' own
    <!-- bench-median: docs/results/X.json overhead.pairs.*.ttft_ms -->             their median
    <!-- bench-count: docs/results/X.json overhead.pairs.*.ttft_ms > 10 -->         "N of M" items over 10
    <!-- bench-count: docs/results/X.json pairs.*.x < docs/results/Y.json pairs.*.x -->  ... under Y's median

Key paths are dotted; a list is indexed by position (`compare.0`) or by the `engine` name of
its entry (`compare.s06_prefill_microbatching`). A key with a space is quoted
("summary.compl tok/s.median"); one that starts with '=' is arithmetic over dotted keys
("=groups_ms_profiled.kv_cache / floor_ms"; a `*` there takes the same item of every list). A missing result file never fails the build
(results are committed after the code); a malformed one, or a key that is not there, does.
Directives inside fenced code blocks are left alone.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import textwrap
from pathlib import Path

from stagewise_commands import default_command, placed_command
from stagewise_results import (DocsError, _admonition, _fence, _first, _fmt, _name, _number, _rel, _value, env_line,
                               load_result, render_bench_results)
from stagewise_values import (render_bench_count, render_bench_median, render_bench_range, render_bench_ratio,
                              render_bench_value)

BLOCK = ("stage-diff", "stage-diff-if-present", "include", "include-if-present", "bench-results", "bench-tabs",
         "ladder-chart", "ladder-table", "parity-table", "serve-pairs")
INLINE = ("bench-value", "bench-ratio", "bench-range", "bench-median", "bench-count")
_NAMES = "|".join(sorted(BLOCK + INLINE, key=len, reverse=True))
DIRECTIVE_RE = re.compile(r"<!--\s*(" + _NAMES + r")\b\s*:?\s*(.*?)\s*-->")
FENCE_RE = re.compile(r"^\s*(`{3,}|~{3,})")

# ----------------------------------------------------------------------------- stage diffs
def _stage_dir(root: Path, name: str) -> Path:
    name = name.strip().strip("/")
    return root / (name if name.startswith("stages/") else f"stages/{name}")


def _py_files(d: Path) -> dict[str, Path]:
    return {p.relative_to(d).as_posix(): p for p in sorted(d.rglob("*.py"))
            if "__pycache__" not in p.parts}


def stage_diff(root: Path, a: str, b: str) -> list[tuple[str, str, int, int, list[str]]]:
    """`diff -ru stages/a stages/b` over *.py files, file by file: [(file, kind, +lines, -lines, diff lines)]."""
    da, db = _stage_dir(root, a), _stage_dir(root, b)
    for d in (da, db):
        if not d.is_dir():
            raise DocsError(f"stage-diff: stage directory {d.relative_to(root)} does not exist")
    fa, fb = _py_files(da), _py_files(db)
    ra, rb = da.relative_to(root).as_posix(), db.relative_to(root).as_posix()
    files: list[tuple[str, str, int, int, list[str]]] = []
    for name in sorted(set(fa) | set(fb)):
        if name not in fb:
            files.append((name, "removed", 0, len(fa[name].read_text().splitlines()),
                          [f"Only in {os.path.dirname(f'{ra}/{name}')}: {os.path.basename(name)}"]))
            continue
        if name not in fa:
            files.append((name, "new", len(fb[name].read_text().splitlines()), 0,
                          [f"Only in {os.path.dirname(f'{rb}/{name}')}: {os.path.basename(name)}"]))
            continue
        old, new = fa[name].read_text().splitlines(), fb[name].read_text().splitlines()
        hunks = list(difflib.unified_diff(old, new, f"{ra}/{name}", f"{rb}/{name}", lineterm=""))
        if not hunks:
            continue
        body = hunks[2:]
        files.append((name, "changed", sum(1 for h in body if h.startswith("+")),
                      sum(1 for h in body if h.startswith("-")), [f"diff -ru {ra}/{name} {rb}/{name}", *hunks]))
    return files


def _is_test(name: str) -> bool:
    return os.path.basename(name).startswith("test_")


def render_stage_diff(root: Path, a: str, b: str, strict: bool = True) -> str:
    """The diff table, then each file's diff folded on its own.

    The page has already shown the idea's code; the diff is for a reader who wants every line
    that changed, one file at a time (the tests' diffs, long and mostly replaced lines, last).
    """
    if not strict and not (_stage_dir(root, a).is_dir() and _stage_dir(root, b).is_dir()):
        missing = [n for n in (a, b) if not _stage_dir(root, n).is_dir()]
        return _admonition("note", "Stage not built yet",
                           f"`stages/{missing[0]}/` does not exist yet. Once it does, this section "
                           f"shows `diff -ru stages/{a} stages/{b}`, generated from the code.")
    files = stage_diff(root, a, b)
    cmd = f"diff -ru {_stage_dir(root, a).relative_to(root)} {_stage_dir(root, b).relative_to(root)}"
    if not files:
        return _admonition("info", "No differences", f"`{cmd}` finds no difference in *.py files.")
    rows = "\n".join(f"| `{f}` | {kind} | {f'+{add}' if add else '—'} | {f'−{rem}' if rem else '—'} |"
                     for f, kind, add, rem, _ in files)
    out = [f"Generated at build time from the code: `{cmd}` (Python files only); each file's diff "
           f"unfolds on a click, the engine's first, its tests last.",
           f"| file | change | added | removed |\n|---|---|--:|--:|\n{rows}"]
    for f, _, add, rem, lines in sorted(files, key=lambda row: _is_test(row[0])):
        fenced = _fence("\n".join(lines), "diff")
        title = f"The tests: `{f}`" if _is_test(f) else f"`{f}`"
        out.append(f'??? note "{title} (+{add} −{rem})"\n\n' + textwrap.indent(fenced, "    ", lambda _: True))
    return "\n\n".join(out)


# ----------------------------------------------------------------------------- includes
LANGS = {".py": "python", ".md": "markdown", ".toml": "toml", ".yml": "yaml", ".yaml": "yaml",
         ".json": "json", ".sh": "bash", "": "text"}


def extract_symbol(source: str, symbol: str, where: str = "?") -> str:
    """The source of a class, function, method (`Class.method`) or top-level assignment."""
    node: ast.AST = ast.parse(source)
    for part in symbol.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [child.name]
            elif isinstance(child, (ast.Assign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            if part in names:
                found = child
        if found is None:
            raise DocsError(f"include: {where} has no {symbol!r} (looked for {part!r})")
        node = found
    decorators = getattr(node, "decorator_list", [])
    start = min([node.lineno] + [d.lineno for d in decorators])
    lines = source.splitlines()[start - 1: node.end_lineno]
    return textwrap.dedent("\n".join(lines))


def render_include(root: Path, spec: str, strict: bool = False) -> str:
    """`path` or `path::Symbol` as a titled code block; a note (or an error) when missing."""
    spec = spec.strip()
    path, _, symbol = spec.partition("::")
    p = root / path
    if not p.is_file():
        if strict:
            raise DocsError(f"include: {path} does not exist")
        return _admonition("note", "Not built yet",
                           f"`{path}` does not exist yet; this block shows it once it does.")
    text = p.read_text()
    if symbol:
        text = extract_symbol(text, symbol, path)
    lang = LANGS.get(p.suffix, "text")
    title = f"{path} · {symbol}" if symbol else path
    return _fence(text, f'{lang} title="{title}"')


# ----------------------------------------------------------------------------- result tabs
def render_bench_tabs(root: Path, args: str, page_src: str | None = None) -> str:
    """`LABEL path | LABEL path ...`: one tab per committed result. The first (the CPU's, which
    every stage has) always shows, as its note when missing; a later one only once its file is
    committed, so a reader never opens a tab that holds nothing."""
    tabs = []
    for i, part in enumerate(p.strip() for p in args.split("|")):
        label, _, path = part.rpartition(" ")
        if not label or not path.endswith(".json"):
            raise DocsError(f"bench-tabs: expected 'LABEL path.json', got {part!r}")
        if i and not (root / path).is_file():
            continue
        body = render_bench_results(root, path, page_src)
        tabs.append(f'=== "{label}"\n\n' + textwrap.indent(body, "    ", lambda _: True))
    return "\n\n".join(tabs)


# ----------------------------------------------------------------------------- ladder
def render_ladder_chart(root: Path, args: str, page_src: str | None = None) -> str:
    path = args.strip() or "docs/results/cpu/ladder.cpu.png"
    if not (root / path).is_file():
        return _admonition("info", "Ladder chart not committed yet",
                           f"`{path}` appears here once it is committed. Produce it with:\n\n"
                           + _fence(default_command(path), "bash"))
    href = _rel(root, path, page_src)
    return (f"[![Throughput and TTFT of every stage on one workload]({href}){{ loading=lazy }}]({href} "
            f"\"the chart at full size\")\n\n*Click the chart for it at full size.*")


LADDER_TABLES = (
    (("completion tok/s", "total tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)"),
     ("throughput_tok_s.completion", "throughput_tok_s.total", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50")),
    (("ITL p99 (ms)", "decode step (ms)", "x floor", "peak KV (MiB)"),
     ("itl_ms.p99", "decode_step_ms", "x_floor", "kv.peak_kv_bytes")),
)


def render_ladder_table(root: Path, args: str, page_src: str | None = None) -> str:
    path = args.strip() or "docs/results/cpu/ladder.cpu.json"
    data = load_result(root, path)
    if data is None:
        return _admonition("warning", "No committed result yet",
                           f"`{path}` is not committed yet. Produce it with:\n\n"
                           + _fence(default_command(path), "bash"))
    entries = _first(data, "entries", "results", "engines", "rows")
    if not isinstance(entries, list) or not entries:
        raise DocsError(f"{path}: expected a non-empty list under 'entries' (or 'results'/'engines')")
    out = [f"**Command:** `{placed_command(data, path)}`", "",
           f"**Environment:** {env_line(data)}. "
           f"Raw JSON: [`{Path(path).name}`]({_rel(root, path, page_src)}).", "",
           "Throughput and latency:", ""]
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise DocsError(f"{path}: entries[{i}] must be an object")
        _number(e, "throughput_tok_s.completion", f"{path} entries[{i}]")
    for heads, keys in LADDER_TABLES:  # two tables of a few columns: each fits the page's column
        out += ["| engine | " + " | ".join(heads) + " |", "|---|" + "--:|" * len(heads)]
        for i, e in enumerate(entries):
            name = f"`{_name(e, str(i))}`" + (" (streaming)" if e.get("mode") == "streaming" else "")
            out.append(f"| {name} | " + " | ".join(_fmt(_value(e, k)) for k in keys) + " |")
        out += ["", "The decode step against the floor, and KV memory:", ""]
    return "\n".join(out[:-3])


def render_parity_table(root: Path, args: str, page_src: str | None = None) -> str:
    """`stagewise parity`'s result: per stage, how many rows equal transformers', and where not."""
    path = args.strip()
    data = load_result(root, path)
    if data is None:
        return _admonition("warning", "No committed result yet",
                           f"`{path}` is not committed yet. Produce it with:\n\n" + _fence(default_command(path), "bash"))
    entries = data.get("entries")
    if data.get("kind") != "parity" or not isinstance(entries, dict) or not entries:
        raise DocsError(f"{path}: expected a `stagewise parity` result with a non-empty 'entries' object")
    lengths = data.get("prompt_lengths") or [0]
    out = [f"**Command:** `{placed_command(data, path)}`", "",
           f"**Environment:** {env_line(data)}. {len(lengths)} prompts of {min(lengths)}–{max(lengths)} "
           f"tokens. Raw JSON: [`{Path(path).name}`]({_rel(root, path, page_src)}).", "",
           "| stage | rows equal | first tokens equal | tokens agreeing | where a row first differs: "
           "request @ token (transformers' margin there) |", "|---|--:|--:|--:|---|"]
    for name, e in entries.items():
        n = int(_number(e, "requests", path))
        diffs = ", ".join(f"#{d['request']} @ {d['first_difference']}"
                          + (f" ({d['reference_margin']:.3f})" if d.get("reference_margin") is not None else "")
                          for d in e.get("differences") or [])
        out.append(f"| `{name}` | {int(_number(e, 'identical', path))}/{n} | "
                   f"{int(_number(e, 'first_tokens_equal', path))}/{n} | {100 * _number(e, 'agreement', path):.1f} % "
                   f"| {diffs or '—'} |")
    return "\n".join(out)


SERVE_PAIR_TABLES = (  # two tables of (heading, key in a pair, suffix): each fits the page's column
    (("prefill, in-process", "prefill_p50_ms.in_process", ""), ("prefill, HTTP", "prefill_p50_ms.http", ""),
     ("net, in-process", "ttft_p50_outside_prefill_ms.in_process", ""),
     ("net, HTTP", "ttft_p50_outside_prefill_ms.http", "")),
    (("HTTP adds (net)", "ttft_p50_added_ms", ""), ("HTTP adds (raw)", "ttft_p50_added_raw_ms", ""),
     ("throughput lost", "throughput_loss_pct", " %"),
     ("intake, in-process", "intake_span_ms.in_process", ""), ("intake, HTTP", "intake_span_ms.http", "")),
)


def render_serve_pairs(root: Path, args: str, page_src: str | None = None) -> str:
    """`stagewise serve-overhead`'s pairs, one row each, however many the run had."""
    path = args.strip()
    data = load_result(root, path)
    if data is None:
        return _admonition("warning", "No committed result yet",
                           f"`{path}` is not committed yet. Produce it with:\n\n"
                           + _fence(f"stagewise serve-overhead --stage 9 --model smollm2-135m --json {path}", "bash"))
    pairs = (data.get("overhead") or {}).get("pairs") if data.get("kind") == "serve-overhead" else None
    if not isinstance(pairs, list) or not pairs:
        raise DocsError(f"{path}: expected a `stagewise serve-overhead` result with 'overhead.pairs'")
    tables = []
    for t, columns in enumerate(SERVE_PAIR_TABLES):
        lead = "| pair | first | " if t == 0 else "| pair | "
        out = [lead + " | ".join(h for h, _, _ in columns) + " |", "|---|" + ("---|" if t == 0 else "") + "--:|" * len(columns)]
        for i, pair in enumerate(pairs):
            first = {"http": "HTTP"}.get(pair.get("first"), pair.get("first", "?"))
            cells = [_fmt(_number(pair, key, f"{path} pair {i + 1}")) + suffix for _, key, suffix in columns]
            out.append(f"| {i + 1} | " + (f"{first} | " if t == 0 else "") + " | ".join(cells) + " |")
        tables.append("\n".join(out))
    return "\n\nWhat HTTP added, and how long each side took to take the burst in:\n\n".join(tables)


# ----------------------------------------------------------------------------- the hook
def _render_block(root: Path, name: str, args: str, page_src: str | None) -> str:
    if name in ("stage-diff", "stage-diff-if-present"):
        stages = args.split()
        if len(stages) != 2:
            raise DocsError(f"{name}: expected two stage names, got {args!r}")
        return render_stage_diff(root, *stages, strict=(name == "stage-diff"))
    if name in ("include", "include-if-present"):
        return render_include(root, args, strict=(name == "include"))
    if name == "bench-tabs":
        return render_bench_tabs(root, args, page_src)
    if name == "bench-results":
        path, _, cmd = args.partition("|")
        return render_bench_results(root, path, page_src, cmd.strip() or None)
    if name == "ladder-chart":
        return render_ladder_chart(root, args, page_src)
    if name == "parity-table":
        return render_parity_table(root, args, page_src)
    if name == "serve-pairs":
        return render_serve_pairs(root, args, page_src)
    return render_ladder_table(root, args, page_src)


def expand(markdown: str, root: Path, page_src: str | None = None) -> str:
    """Replace every directive outside fenced code blocks."""
    out: list[str] = []
    fence: str | None = None
    for line in markdown.split("\n"):
        m = FENCE_RE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line.strip()[len(m.group(1)):].strip():
                fence = None
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        whole = DIRECTIVE_RE.fullmatch(line.strip())
        if whole and whole.group(1) in BLOCK:
            indent = line[: len(line) - len(line.lstrip())]
            block = _render_block(root, whole.group(1), whole.group(2), page_src)
            out.extend((indent + ln) if ln else "" for ln in block.split("\n"))
            continue

        def inline(mm: re.Match) -> str:
            if mm.group(1) in BLOCK:
                raise DocsError(f"{mm.group(1)} must be alone on its line: {line.strip()!r}")
            render = {"bench-value": render_bench_value, "bench-ratio": render_bench_ratio,
                      "bench-range": render_bench_range, "bench-median": render_bench_median,
                      "bench-count": render_bench_count}[mm.group(1)]
            return render(root, mm.group(2))

        out.append(DIRECTIVE_RE.sub(inline, line))
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs API)
    root = Path(config["config_file_path"]).resolve().parent
    src = page.file.src_uri
    try:
        return expand(markdown, root, src)
    except DocsError as e:
        raise DocsError(f"docs/{src}: {e}") from e
