"""Markdown from the committed bench JSON (`docs/results/*.json`), for the stagewise hook.

Why separate: the hook (stagewise.py) finds directives; this module knows the JSON shape that
common/bench/harness.py writes (design.md, "Bench JSON") and turns it into tables. A missing file is
`None` (the page says how to produce it); a malformed one raises DocsError, failing the build.
Beside it: stagewise_commands.py (the command under each table, which this module imports) and
stagewise_values.py (single figures inside a sentence, reading results through `load_result` and
`lookup` here).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from stagewise_commands import default_command, placed_command, wrap_command

try:  # the hook runs under mkdocs; the tests import it without a build
    from mkdocs.exceptions import PluginError as _Base
except ImportError:  # pragma: no cover
    _Base = Exception


class DocsError(_Base):
    """A directive that cannot be honoured: the strict build must stop, with this message."""


# Percentile blocks, in the order of the posts' `=== streaming benchmark ===` report.
PCT_METRICS: list[tuple[str, str]] = [
    ("submit_lag_ms", "Submit lag (ms)"),
    ("add_request_ms", "add_request latency (ms)"),
    ("tokenize_ms", "Tokenize (ms)"),
    ("queue_wait_ms", "Queue wait, post-tok (ms)"),
    ("prefill_to_first_token_ms", "Prefill → first token (ms)"),
    ("ttft_ms", "TTFT (ms)"),
    ("tpot_ms", "TPOT (ms/token)"),
    ("itl_ms", "ITL (ms)"),
    ("latency_ms", "Latency (ms)"),
]
REQUIRED_PCT = ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms")
PCTS = ("p50", "p95", "p99")


# ----------------------------------------------------------------------------- helpers
def _fence(body: str, info: str) -> str:
    """A fenced block whose fence is longer than any backtick run inside `body`."""
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{info}\n{body.rstrip(chr(10))}\n{ticks}"


def _admonition(kind: str, title: str, body: str) -> str:
    lines = body.strip("\n").splitlines()
    return f'!!! {kind} "{title}"\n\n' + "\n".join(("    " + ln) if ln else "" for ln in lines)


def _fmt(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "—" if x is None else str(x)
    return "—" if math.isnan(x) else f"{x:,.2f}"


def _rel(root: Path, target: str, page_src: str | None) -> str:
    """Link from the page (path relative to docs/) to a repo path under docs/."""
    docs_rel = os.path.relpath(root / target, root / "docs")
    page_dir = os.path.dirname(page_src or "")
    return os.path.relpath(docs_rel, page_dir or ".").replace(os.sep, "/")


# ----------------------------------------------------------------------------- bench JSON
def load_result(root: Path, path: str) -> dict | None:
    """The parsed JSON, None when the file is not committed yet; DocsError when malformed."""
    p = root / path
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DocsError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise DocsError(f"{path}: expected a JSON object at the top level")
    return data


def lookup(data: Any, key: str, path: str = "?") -> Any:
    """Follow a dotted key; list items by index or by their `engine` name (a profile's `ops` rows
    by their `op` name, e.g. `ops.aten::index_select.ms_per_step`: a row's place moves between runs).
    A part of digits is an index; a name must be the only item of that name (and holds no dot)."""
    cur = data
    for part in key.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        elif isinstance(cur, list) and (named := [e for e in cur if isinstance(e, dict)
                                                  and part in (e.get("engine"), e.get("op"))]):
            if len(named) > 1:
                raise DocsError(f"{path}: {key!r}: {len(named)} items named {part!r}")
            cur = named[0]
        else:
            raise DocsError(f"{path}: no key {key!r} (stopped at {part!r})")
    return cur


def _number(data: Any, key: str, path: str) -> float:
    v = lookup(data, key, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DocsError(f"{path}: {key!r} is {v!r}, not a number")
    return float(v)


def check_result(data: dict, path: str) -> None:
    """The minimum shape common/bench/harness.py promises (see design.md, "Bench JSON")."""
    for key in ("throughput_tok_s.completion", "throughput_tok_s.total"):
        _number(data, key, path)
    for m in REQUIRED_PCT:
        for p in PCTS:
            _number(data, f"{m}.{p}", path)
    for name in ("runs", "compare"):
        if name in data and not isinstance(data[name], list):
            raise DocsError(f"{path}: {name!r} must be a list")
    for i, entry in enumerate(data.get("compare") or []):
        if not isinstance(entry, dict):
            raise DocsError(f"{path}: compare[{i}] must be an object")
        for key in ("throughput_tok_s.completion", "ttft_ms.p50", "tpot_ms.p50", "latency_ms.p50"):
            _number(entry, key, f"{path} compare[{i}]")


def _first(d: dict, *keys: str) -> Any:
    for k in keys:
        if d.get(k) not in (None, ""):
            return d[k]
    return None


def env_line(data: dict) -> str:
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    bits = []
    commit, dirty = _first(env, "git_commit", "commit"), _first(env, "git_dirty", "dirty")
    if commit or dirty is not None:
        where = f"commit `{str(commit)[:10]}`" if commit else "commit not recorded"
        bits.append(where + (" (uncommitted changes)" if dirty else ""))
    dev = _first(env, "device_name", "gpu", "device") or data.get("device")
    if dev:
        bits.append(f"device {dev}")
    cpu = _first(env, "cpu", "cpu_model", "processor")
    if cpu:
        family, kernels = _first(env, "cpu_family_model"), _first(env, "cpu_capability")
        detail = ", ".join(x for x in (family and f"family/model {family}", kernels and f"{kernels} kernels") if x)
        bits.append(f"CPU {cpu}" + (f" ({detail})" if detail else ""))
    threads = _first(env, "threads", "torch_threads", "num_threads")
    if threads:
        bits.append(f"{threads} threads")
    for label, keys in (("torch", ("torch", "torch_version")),
                        ("transformers", ("transformers", "transformers_version"))):
        v = _first(env, *keys)
        if v:
            bits.append(f"{label} {v}")
    py = _first(env, "python")
    if py:
        bits.append(f"Python {py}")
    when = _first(env, "timestamp_utc", "timestamp", "date")
    if when:
        bits.append(f"measured {when}")
    model = data.get("model")
    if model:
        why = f" ({data['dtype_reason']})" if data.get("dtype_reason") else ""  # how --dtype chose it
        bits.append(f"model `{model}` {data.get('dtype') or ''}".rstrip() + why)
    return " · ".join(bits) if bits else "not recorded"


def _spread(data: dict, key: str) -> str:
    runs = [r for r in (data.get("runs") or []) if isinstance(r, dict)]
    vals = []
    for r in runs:
        try:
            v = lookup(r, key)
        except DocsError:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals.append(float(v))
    if len(vals) < 2:
        return ""
    return f" <small>({min(vals):,.2f}–{max(vals):,.2f})</small>"


def _submit_info(data: dict) -> str:
    """Streaming runs: how the requests arrived."""
    if data.get("submit_interval_ms") is None:
        return ""
    return (f"; submitted every {_fmt(data['submit_interval_ms'])} ms ({data.get('submit_schedule', '?')} "
            f"schedule) over {_fmt(data.get('submit_wall_s'))} s")


def _with_spread(data: dict, key: str) -> str:
    return _fmt(lookup(data, key)) + _spread(data, key)


def _name(entry: dict, default: str) -> str:
    return str(_first(entry, "engine", "stage", "name") or default)


# (label, key, higher_is_better)
COMPARE_ROWS: list[tuple[str, str, bool]] = [
    ("Throughput, completion (tok/s)", "throughput_tok_s.completion", True),
    ("Throughput, total (tok/s)", "throughput_tok_s.total", True),
    ("Queue wait p50 (ms)", "queue_wait_ms.p50", False),
    ("Prefill → first token p50 (ms)", "prefill_to_first_token_ms.p50", False),
    ("TTFT p50 (ms)", "ttft_ms.p50", False),
    ("TTFT p99 (ms)", "ttft_ms.p99", False),
    ("TPOT p50 (ms/token)", "tpot_ms.p50", False),
    ("ITL p50 (ms)", "itl_ms.p50", False),
    ("Decode step (ms)", "decode_step_ms", False),
    ("x floor", "x_floor", False),
    ("Latency p50 (ms)", "latency_ms.p50", False),
    ("Latency p99 (ms)", "latency_ms.p99", False),
    ("Peak KV memory (MiB)", "kv.peak_kv_bytes", False),
]


def _value(entry: dict, key: str) -> float | None:
    try:
        v = lookup(entry, key)
    except DocsError:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v / 2**20 if key.endswith("_bytes") else float(v)


def _compare_table(data: dict, ours: str) -> str:
    others = [e for e in data.get("compare") or [] if isinstance(e, dict)]
    names = [_name(e, f"compare[{i}]") for i, e in enumerate(others)]
    head = f"| metric | **{ours}** (this stage) | " + " | ".join(f"`{n}`" for n in names)
    head += " | " + " | ".join(f"× vs `{n}`" for n in names) + " |"
    sep = "|---|--:|" + "--:|" * (2 * len(names))
    rows = []
    for label, key, higher in COMPARE_ROWS:
        mine = _value(data, key)
        theirs = [_value(e, key) for e in others]
        if mine is None and all(t is None for t in theirs):
            continue
        ratios = []
        for t in theirs:
            if mine is None or t is None or mine == 0 or t == 0:
                ratios.append("—")
            else:
                ratios.append(f"{(mine / t) if higher else (t / mine):.2f}×")
        rows.append(f"| {label} | {_fmt(mine)} | " + " | ".join(_fmt(t) for t in theirs)
                    + " | " + " | ".join(ratios) + " |")
    return "\n".join([head, sep, *rows])


def _fresh(data: dict) -> bool:
    """Results written before fresh processes became the default have no `process` field."""
    process = data.get("process")
    return isinstance(process, dict) and bool(process.get("fresh_process"))


def _floor_lines(data: dict) -> list[str]:
    """Decode step against the matmul floor ([Metrics](metrics.md)); nothing for older results."""
    step, base, ratio = (_value(data, k) for k in ("decode_step_ms", "floor_ms", "x_floor"))
    if step is None or base is None or ratio is None:
        return []
    return ["", f"Decode step: **{step:,.2f} ms**, **{ratio:.2f}× the matmul floor** "
                f"({base:,.3f} ms for the model's matmuls alone at batch {data.get('floor_batch', '?')})."]


def render_bench_results(root: Path, path: str, page_src: str | None = None,
                         command: str | None = None) -> str:
    path = path.strip()
    data = load_result(root, path)
    if data is None:
        cmd = command or default_command(path)
        return _admonition("warning", "No committed result yet",
                           f"`{path}` is not committed yet. Produce it with:\n\n"
                           + _fence(cmd, "bash"))
    check_result(data, path)
    ours = _name(data, Path(path).name.split(".")[0])
    runs = data.get("runs") or []
    cfg = data.get("config") or {}
    reps = f"median of {len(runs)} repeats" if len(runs) > 1 else "a single run"
    if isinstance(cfg, dict) and cfg.get("warmup_runs") is not None:
        reps += f" after {cfg['warmup_runs']} warmup run{'s' if cfg['warmup_runs'] != 1 else ''}"
    out = [
        "**Command:**",
        "",
        _fence(wrap_command(placed_command(data, path)), "bash"),
        "",
        f"**Environment:** {env_line(data)}",
        "",
        f"**Workload:** {data.get('requests', '?')} requests, {data.get('prompt_tokens', '?')} prompt "
        f"+ {data.get('completion_tokens', '?')} completion tokens; "
        f"wall {_fmt(data.get('wall_s'))} s; {reps}{_submit_info(data)}. "
        f"Raw JSON: [`{Path(path).name}`]({_rel(root, path, page_src)}).",
        "",
        "| metric | p50 | p95 | p99 |",
        "|---|--:|--:|--:|",
    ]
    for key, label in PCT_METRICS:
        if isinstance(data.get(key), dict):
            out.append(f"| {label} | " + " | ".join(_with_spread(data, f"{key}.{p}") for p in PCTS) + " |")
    out += ["", "| throughput | tokens/s |", "|---|--:|",
            f"| completion | {_with_spread(data, 'throughput_tok_s.completion')} |",
            f"| total (prompt + completion) | {_with_spread(data, 'throughput_tok_s.total')} |"]
    peak = _value(data, "kv.peak_kv_bytes")
    if peak is not None:
        out += ["", f"Peak KV cache memory: **{peak:,.2f} MiB**."]
    out += _floor_lines(data)
    if len(runs) >= 2:
        out += ["", "Values are medians over the repeats; <small>(min–max)</small> is their spread."]
    if data.get("compare"):
        rounds = (data.get("config") or {}).get("rounds") or 1
        where = "each engine in its own fresh process" if _fresh(data) else "same process"
        if _fresh(data) and rounds > 1:
            where = f"each engine in {rounds} fresh processes, interleaved"
        out += ["", f"**Side by side, same workload, {where}** "
                    f"(× = how many times better `{ours}` is: higher throughput or lower time/memory):",
                "", _compare_table(data, ours), ""]
        for i, other in enumerate(data["compare"]):
            name = _name(other, f"compare[{i}]")
            out.append(f"- Completion throughput vs `{name}`: {noise_verdict(data, other)}.")
    out += _correctness_lines(data)
    notes = data.get("notes")
    if isinstance(notes, list) and notes:
        out += ["", "Notes from the run:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out)


def _runs_of(entry: dict, key: str) -> list[float]:
    vals = []
    for r in entry.get("runs") or []:
        v = _value(r, key) if isinstance(r, dict) else None
        if v is not None:
            vals.append(v)
    return vals


def noise_verdict(a: dict, b: dict, key: str = "throughput_tok_s.completion") -> str:
    """Is the difference larger than the run-to-run spread? (per-run ranges must not overlap)"""
    ra, rb = _runs_of(a, key), _runs_of(b, key)
    if len(ra) < 2 or len(rb) < 2:
        return "too few repeats to tell a difference from noise"
    if max(ra) < min(rb) or max(rb) < min(ra):
        return "the difference is **outside** the run-to-run spread"
    return "the per-run ranges overlap: the difference is **within the noise**"


def _correctness_lines(data: dict) -> list[str]:
    c = data.get("correctness")
    if not isinstance(c, dict) or not c.get("checked"):
        return []
    if c.get("equal"):
        return ["", "Correctness, checked before timing: greedy token ids are identical across all engines."]
    who = ", ".join(f"`{k}`" for k in (c.get("mismatches") or {})) or "some engine"
    return ["", f"!!! failure \"Token ids differ\"\n\n    Greedy token ids of {who} differ from "
                f"this stage's on the first warmup: the timings compare different work."]
