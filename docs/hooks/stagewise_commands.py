"""The command that wrote a committed result, for the stagewise hook and scripts/rerun_results.py.

A page shows, under every table, the command a reader runs to get that table again; the rerun
script runs exactly those commands. Both read them here: the result's own `command`, or one
rebuilt from its `config` (the flags the benchmark was given), placed where the file lies now;
for a file not committed yet, guessed from its name.
"""

from __future__ import annotations

import shlex
from pathlib import Path

# Flags that store False: the config's key, and the flag to write when the value is False.
FLAGS_FOR_FALSE = {"stop_on_eos": "--no-stop-on-eos", "prefix_cache": "--no-prefix-cache",
                   "fresh_engine": "--reuse-engine"}
CONFIG_SKIP = ("stage", "command", "argv", "func")
# Streaming-benchmark flags: noise in the command of an offline (generate()) run.
STREAMING_ONLY = ("pretok", "pretok_base_token_ids", "tokenize_workers", "stream_interval",
                  "submit_interval_ms", "submit_schedule", "request_timeout_s")


def default_command(path: str) -> str:
    """The command that writes `path`, guessed from its name (`<stage>.<device>.json`)."""
    name = Path(path).name
    stem, _, rest = name.partition(".")
    device = rest.split(".")[0] if rest.count(".") >= 1 else "cpu"
    if stem.startswith("ladder"):
        # ladder.<device>[.<tag>].json; a tag named after a workload was written by `--workload <tag> --tag`.
        tag = rest.split(".")[1] if rest.count(".") >= 2 else None
        workload = f" --workload {tag} --tag" if tag else ""
        mode = " --mode streaming" if tag == "burst" else ""
        return f"stagewise ladder --device {device}{workload}{mode} --out {Path(path).parent.as_posix()}"
    if stem == "parity":  # parity.<dtype>.<device>.json
        dtype, _, device = rest.partition(".")
        device = device.split(".")[0]
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        return f"stagewise parity --model smollm2-135m --dtype {dtype} --device {device} --json {path}"
    dev = " --device cuda" if device == "cuda" else ""
    return f"python -m stages.{stem}.bench --compare{dev} --json {path}"


def command_from(data: dict) -> str:
    """The command line that produced this result, rebuilt from its `config`."""
    if isinstance(data.get("command"), str):
        return data["command"]
    cfg = data.get("config") or {}
    module = f"stages.{data['stage']}.bench" if data.get("stage") else "common.bench"
    if isinstance(cfg.get("argv"), list):
        return shlex.join(["python", "-m", module, *map(str, cfg["argv"])])
    parts = ["python", "-m", module]
    offline = data.get("mode") == "offline"
    # A text prompt is a kind of prompt of its own: typed beside chat questions or random token
    # prompts, `--prompt` replaces them (flags.prompt_kind_typed), so it is spelled only where it ran.
    text_prompt = not cfg.get("chat_prompts") and cfg.get("prompt_len_min") is None
    for key, val in cfg.items():
        if key in CONFIG_SKIP or val is None or (offline and key in STREAMING_ONLY):
            continue
        if key == "prompt" and not text_prompt:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "enforce_eager":  # three-way: unset (None, skipped above), --enforce-eager, --no-enforce-eager
            parts.append(flag if val else "--no-enforce-eager")
        elif key in FLAGS_FOR_FALSE:
            if val is False:
                parts.append(FLAGS_FOR_FALSE[key])
        elif val is True:
            parts.append(flag)
        elif val is False or isinstance(val, dict):
            continue  # a store_true flag left off; nested data is no flag
        elif isinstance(val, (list, tuple)):
            parts += [flag, *map(str, val)]
        else:
            parts += [flag, str(val)]
    return shlex.join(parts)


def placed(words: list[str], path: str) -> list[str]:
    """A result's command, writing where the result lies now: its `--json` is `path`, a ladder's
    `--out` the folder `path` is in. The file may have been written to a scratch path and copied
    in, or moved since (docs/results/ is laid out by device, machine and question)."""
    words = list(words)
    if "--json" in words[:-1]:
        words[words.index("--json") + 1] = path
    elif "--out" in words[:-1]:
        words[words.index("--out") + 1] = Path(path).parent.as_posix()
    return words


def placed_command(data: dict, path: str) -> str:
    """`command_from(data)`, as `placed` puts it: the command that writes this very file."""
    return shlex.join(placed(shlex.split(command_from(data)), path))


def wrap_command(cmd: str, width: int = 88) -> str:
    """Break a long command before its flags, shell-style, so it reads (and copies) well."""
    words = shlex.split(cmd)
    lines, cur = [], ""
    for w in words:
        q = shlex.quote(w)
        if cur and w.startswith("--") and len(cur) + 1 + len(q) > width:
            lines.append(cur + " \\")
            cur = "  " + q
        else:
            cur = f"{cur} {q}" if cur else q
    return "\n".join(lines + [cur])
