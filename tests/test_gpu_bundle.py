"""scripts/gpu_bundle.py's split: SmolLM2's GGUF must reach the GPU machine whole, in as few calls
as fit (the first call carries the wheels too, so its piece is smaller), each piece under its
call's room, and the manifest `gpu_env.sh` checks the joined file against must name them in order."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from conftest import load_script

gpu_bundle = load_script("gpu_bundle")


@pytest.mark.parametrize("size, first, rest, count", [(100, 45, 60, 2), (100, 100, 60, 1), (200, 30, 60, 4)])
def test_pieces_fit_their_calls_and_join_to_the_file(tmp_path: Path, size: int, first: int, rest: int,
                                                     count: int) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * (size // 256) + bytes(range(size % 256)))
    (tmp_path / "out" / "base").mkdir(parents=True)
    pieces = gpu_bundle.split(src, first, rest, tmp_path / "out")
    assert len(pieces) == count
    assert [p.parent.name for p in pieces] == [f"gguf-{i + 1}" for i in range(count)]
    assert all(p.stat().st_size <= cap for p, cap in zip(pieces, [first] + [rest] * count))
    assert b"".join(p.read_bytes() for p in pieces) == src.read_bytes()
    digest, name, *names = (tmp_path / "out" / "base" / "gguf.sha256").read_text().split()
    assert digest == hashlib.sha256(src.read_bytes()).hexdigest() and name == "model.gguf"
    assert names == [p.name for p in pieces]
