"""Where a number came from: commit, dirty flag, versions, hardware.

A benchmark result without this is an anecdote. Every `--json` result embeds `collect_env()`
so a later reader can tell whether two numbers are comparable (same commit? same CPU?).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from common.linear import ROWS_ENV, cpuinfo

REPO_ROOT = Path(__file__).resolve().parents[2]


RESULTS_DIR = "docs/results"


def _git(*args: str) -> str | None:
    """Run a git command in the repo; None when git or the repo is missing (e.g. a wheel)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info() -> dict:
    if os.environ.get("STAGEWISE_GIT_COMMIT"):
        # A copy of the working tree sent to a GPU machine (scripts/README.md): the command that sent
        # it says which commit it is, and whether it had uncommitted edits. It wins over a .git
        # found there, which can be older than the tree: the device tool's copy once carried the
        # session's first commit, and results of later code said that commit, dirty.
        return {"git_commit": os.environ["STAGEWISE_GIT_COMMIT"],
                "git_dirty": os.environ.get("STAGEWISE_GIT_DIRTY", "1") not in ("0", "")}
    commit = _git("rev-parse", "HEAD")
    # Tracked code only: the result files being written, the committed results an earlier run in
    # the same batch rewrote (docs/results/), and new unused files do not change what is measured,
    # so they must not mark a run made from a clean checkout as dirty.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


# The code's state when this process loaded it. A run takes minutes to hours, and what it measured
# is the code it imported then: a commit, or an edit, made in the checkout meanwhile would
# otherwise be written into its JSON as if the run had measured it.
GIT_AT_START = git_info()


def cpu_model(info: dict[str, str]) -> str:
    return info.get("model name") or platform.processor() or platform.machine()


CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_features(info: dict[str, str]) -> dict:
    """What a CPU's name leaves out ("AMD EPYC" covers several generations): its family and model,
    the vector and matrix extensions kernels choose by, and which of ATen's kernel sets runs.
    Results from two sets differ in speed, and in bf16 in rounding too (tests/test_bf16.py)."""
    fields: dict = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if not info:
        return fields
    if "cpu family" in info and "model" in info:
        fields["cpu_family_model"] = f"{info['cpu family']}/{info['model']}"
    flags = set(info.get("flags", "").split())
    fields["cpu_flags"] = [f for f in CPU_FLAGS if f in flags]
    return fields


# Environment variables that change how fast the same code runs on the same machine: thread counts
# and pinning (OpenMP, MKL, oneDNN), glibc malloc's thresholds, PyTorch's huge-page allocations,
# a preloaded allocator. A result measured with one of them set is not comparable to one without.
SPEED_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "DNNL_", "ONEDNN_", "MALLOC_", "THP_MEM_ALLOC_ENABLE",
                      "LD_PRELOAD", "PYTORCH_", "CUDA_VISIBLE_DEVICES", ROWS_ENV)


def speed_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of SPEED_ENV_PREFIXES set in this process, by name (empty: none was set)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(SPEED_ENV_PREFIXES)}


def device_name(device: str | torch.device | None = None) -> str:
    """The accelerator's marketing name, or "cpu"."""
    dev = torch.device(device) if device not in (None, "auto") else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev.index or 0)
    return dev.type


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def collect_env(device: str | torch.device | None = None) -> dict:
    """Everything needed to judge whether two results are comparable.

    The git fields are the code's state when the process started (what the run measured); if the
    checkout has moved since, `git_now` says where to and `code_changed_during_run` is True."""
    now = git_info()
    info = cpuinfo()
    moved = {} if now == GIT_AT_START else {"git_now": now, "code_changed_during_run": True}
    return {
        **GIT_AT_START,
        **moved,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "device_name": device_name(device),
        "cpu_model": cpu_model(info),
        **cpu_features(info),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "speed_env": speed_env(),
        "platform": platform.platform(),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
