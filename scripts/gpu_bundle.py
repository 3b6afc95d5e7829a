"""Pack what a GPU machine without a package index needs to run stagewise from this checkout.

    make venv && .venv/bin/python scripts/gpu_bundle.py     # here, once: writes .device/

Then, on the GPU machine (the working tree copied there, with the folders this prints), one
call per GGUF piece, back to back (scripts/README.md gives the calls):

    bash scripts/gpu_session.sh 225        # carrying .device/base, .device/whl, .device/gguf-1
    bash scripts/gpu_session.sh 190        # carrying .device/base, .device/gguf-2
    bash scripts/gpu_session.sh 395        # carrying .device/base, .device/gguf-3

Why it looks like this: the GPU machines this project borrows have Python 3.12 with a CUDA build
of torch and transformers, no package index, and take at most 64 MiB of files per call. So the
bundle holds only what their image lacks, in the exact versions `make venv` installed here:

- `.device/base/smollm2-135m-tokenizer/`: the converted tokenizer (3 MB), carried by every call.
  `tiny` and `gpt2-random` are built there from it, so no model travels for the tests or for
  timing, and a call that finds a fresh machine can still time `gpt2-random`.
- `.device/whl/`: wheels of the serving and client stack (FastAPI, uvicorn, the openai SDK,
  gguf, ...), the dependency closure read from this venv's metadata, minus the packages the GPU
  image brings in its own build (torch, transformers, numpy, ...). Carried by the first call only.
- `.device/gguf-1/`, `.device/gguf-2/`, ...: SmolLM2's GGUF (98 MB) in as few pieces as fit, one
  per call: the first beside base and the wheels, the others beside base alone (three pieces, at
  today's sizes). `gpu_env.sh` keeps each piece on the machine (while it stays warm, 30 s after a
  call) and joins them once all have come.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROOTS = ["fastapi", "uvicorn", "httptools", "openai", "httpx", "gguf"]  # what the image lacks (KINDS.md)
# In the GPU image already, built for it: never shadow these with this machine's versions.
IMAGE_HAS = {canonicalize_name(n) for n in (
    "torch transformers tokenizers safetensors huggingface-hub numpy pyyaml tqdm requests regex "
    "filelock fsspec packaging jinja2 markupsafe sympy networkx uvloop accelerate").split()}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]


CALL_LIMIT = 64 * 2**20  # what one call to the GPU machine carries: the checkout and the carried folders
MARGIN = 2 * 2**20  # room for the result files a session commits between its calls


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkout_bytes() -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def closure(roots: list[str]) -> dict[str, str]:
    """{name: version} of `roots` and everything they require here, minus IMAGE_HAS."""
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = canonicalize_name(stack.pop())
        if name in found or name in IMAGE_HAS:
            continue
        dist = md.distribution(name)
        found[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                stack.append(req.name)
    return found


def download(pins: dict[str, str], dest: Path) -> None:
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any",
                    "-d", str(dest), *(f"{n}=={v}" for n, v in sorted(pins.items()))], check=True)


def split(src: Path, first: int, rest: int, out: Path) -> list[Path]:
    """`src` in as few pieces as fit calls with room for `first` bytes, then `rest` bytes each:
    out/gguf-1/<name>.part1, ..., and a manifest line per piece. The first call carries the wheels
    too, so its piece is smaller. What room is left over is shared out evenly, so that every call
    keeps the same slack for what the checkout gains before the session (results, commits)."""
    data = src.read_bytes()
    caps = [first]
    while sum(caps) < len(data):
        caps.append(rest)
    slack = (sum(caps) - len(data)) // len(caps)
    bounds = [0]
    for cap in caps:
        bounds.append(min(bounds[-1] + cap - slack, len(data)))  # only the last can pass the end
    pieces = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        folder = out / f"gguf-{i + 1}"
        folder.mkdir(parents=True)
        piece = folder / f"{src.name}.part{i + 1}"
        piece.write_bytes(data[lo:hi])
        pieces.append(piece)
    (out / "base" / "gguf.sha256").write_text(
        f"{hashlib.sha256(data).hexdigest()}  {src.name}\n" + "".join(f"{p.name}\n" for p in pieces))
    return pieces


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / ".device"))
    a = p.parse_args()
    from common.gguf_convert import convert_smollm2, find_smollm2_gguf
    from common.loader import cache_root

    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "whl").mkdir(parents=True)
    pins = closure(ROOTS)
    download(pins, out / "whl")
    tokenizer = convert_smollm2(cache_root() / "smollm2-135m-tokenizer", tokenizer_only=True)
    shutil.copytree(tokenizer, out / "base" / "smollm2-135m-tokenizer")
    gguf, checkout, base, whl = find_smollm2_gguf(), checkout_bytes(), tree_bytes(out / "base"), tree_bytes(out / "whl")
    room = CALL_LIMIT - checkout - base - MARGIN  # what a call has left beside the checkout and base
    pieces = split(gguf, room - whl, room, out)
    if out.is_relative_to(REPO) and subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=REPO).returncode != 0:
        # Ignored, or every call would carry all of it in the working tree (over its 64 MiB).
        with (REPO / ".git" / "info" / "exclude").open("a") as f:
            f.write(f"/{out.relative_to(REPO)}/\n")

    print(f"checkout: {checkout / 2**20:.1f} MiB; {out}/base: the tokenizer, {base / 2**20:.1f} MiB; "
          f"{out}/whl: {len(pins)} wheels, {whl / 2**20:.1f} MiB")
    for piece in pieces:
        print(f"{piece.parent}: {piece.stat().st_size / 2**20:.1f} MiB")
    rel = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    print("\nEach call carries base and one GGUF piece, the first the wheels too (64 MiB a call, the checkout included):")
    for i in range(len(pieces)):
        extra = f', "{rel}/whl"' if i == 0 else ""
        print(f'  call {i + 1}: carry ["{rel}/base"{extra}, "{rel}/gguf-{i + 1}"]')
    print("and its command starts with:  source scripts/gpu_env.sh &&  (or is scripts/gpu_session.sh)")


if __name__ == "__main__":
    main()
