"""Decode attention over one K/V rectangle padded to the step's longest row, against the rows split
in two by length (each group padded to its own longest): what the padding costs on the lengths of
stage 13's own workload, and whether a second call would buy it back.

    python scripts/decode_padding_bench.py --dtype bfloat16 --record LENGTHS
    python scripts/decode_padding_bench.py --dtype bfloat16 --lengths LENGTHS --json FILE

`--record` runs stage 13's bench once (its `BENCH` workload: 64 chat prompts, up to 512 new
tokens, a KV pool for 8 at their worst, so requests of very different lengths decode side by side)
and keeps every decode step's row lengths. The replay runs in a process of its own (in the bench's
own process both forms timed several percent off a fresh process's figures): for every
`--every`-th step, decode attention both ways, alternated, in every layer (each its own pool, so
the K/V come from memory, as in a step, not from a cache one layer would fit in): copy the rows'
blocks out of a pool laid out as `KVBlockPool`'s (`index_select`), then
`common.model.decode_attention`. SmolLM2-135M's shapes: 30 layers, 3 KV heads, 3 query heads
each, head size 64, blocks of 16 tokens. Reported: each form's median over rounds of its ms a
layer, per step, and how much smaller the split's rectangles are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.bench.floor import median_ms  # noqa: E402
from common.bench.results import write_script_result  # noqa: E402
from common.model import additive_mask, decode_attention  # noqa: E402

LAYERS, HKV, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 16


def record_lengths(dtype: str) -> tuple[list[list[int]], dict]:
    """Stage 13's bench, once: every decode step's row lengths, and the bench's result."""
    import stages.s13_preemption.attention as attention
    from common.bench.harness import run_stage_bench

    steps: list[list[int]] = []
    init = attention.DecodeAttention.__init__

    def recording(self: Any, pool: Any, new_slots: torch.Tensor, blocks: torch.Tensor,
                  lengths: torch.Tensor) -> None:  # the same init, and its lengths kept
        init(self, pool, new_slots, blocks, lengths)
        steps.append(lengths.tolist())

    attention.DecodeAttention.__init__ = recording
    try:
        argv = ["--dtype", dtype, "--warmup-runs", "0", "--repeat-runs", "1"]
        result = run_stage_bench("stages.s13_preemption", argv)
    finally:
        attention.DecodeAttention.__init__ = init
    return steps, result


def split_point(blocks: list[int]) -> tuple[int, int]:
    """Rows' block counts, longest first -> (cut, blocks read): the rows [:cut] and [cut:] make the
    two rectangles (each padded to its own longest row) of fewest blocks; cut == len(blocks) when
    one rectangle is already the fewest."""
    n = len(blocks)
    best, cut = n * blocks[0], n
    for c in range(1, n):
        area = c * blocks[0] + (n - c) * blocks[c]
        if area < best:
            best, cut = area, c
    return cut, best


class Group(NamedTuple):
    """Some of a step's rows as one rectangle: which rows, the pool rows to copy out (one index for
    K and V, head after head: [Hkv * n * nb]), and the length mask [1, n, 1, nb * bs]."""

    rows: slice
    index: torch.Tensor
    mask: torch.Tensor


class Step:
    """One recorded step, set up once as a paged stage would hold it: each row's own blocks, distinct,
    from a pool of `pool_blocks`; the block table padded with block 0 up to the rectangle's width
    (as a fresh `BlockTables` row is; a reused row keeps its last session's entries there, masked
    either way); queries as the stages pass them. Rows are sorted longest first, so that a cut in
    two is a slice."""

    def __init__(self, lengths: list[int], pool_blocks: int, dtype: torch.dtype, g: torch.Generator) -> None:
        self.lengths = torch.tensor(sorted(lengths, reverse=True))  # [B], longest first
        counts = [-(-n // BLOCK) for n in self.lengths.tolist()]
        B, nb = len(counts), counts[0]
        free = torch.randperm(pool_blocks - 1, generator=g) + 1  # block 0 pads the tables
        self.table = torch.zeros(B, nb, dtype=torch.long)  # [B, nb]
        taken = 0
        for i, c in enumerate(counts):  # a longer step than the pool holds reuses blocks: fine for timing
            self.table[i, :c] = free[torch.arange(taken, taken + c) % free.numel()]
            taken += c
        self.q = torch.randn(B, HKV, GROUP, HEAD_DIM, generator=g).to(dtype).transpose(0, 1)  # [Hkv, B, G, D] view
        cut, self.split_blocks = split_point(counts)
        self.one_blocks, self.real_tokens = B * nb, int(self.lengths.sum())
        self.one = [self.group(0, B, nb, pool_blocks, dtype)]
        self.split = [self.group(0, cut, nb, pool_blocks, dtype)]
        if cut < B:
            self.split.append(self.group(cut, B, counts[cut], pool_blocks, dtype))

    def group(self, lo: int, hi: int, nb: int, pool_blocks: int, dtype: torch.dtype) -> Group:
        """Rows lo..hi-1 as one rectangle of nb blocks each (`KVBlockPool.block_rows`' index)."""
        heads = torch.arange(HKV) * pool_blocks  # [Hkv]: where each head's blocks start in the flat pool
        index = (heads[:, None] + self.table[lo:hi, :nb].reshape(-1)[None, :]).reshape(-1)  # [Hkv * n * nb]
        keys = torch.arange(nb * BLOCK)
        mask = additive_mask((keys < self.lengths[lo:hi, None])[None, :, None, :], dtype)  # [1, n, 1, nb * bs]
        return Group(slice(lo, hi), index, mask)

    def attend(self, k: torch.Tensor, v: torch.Tensor, groups: list[Group], scratch: torch.Tensor) -> torch.Tensor:
        """One layer: each group's blocks copied out of the pool into a reused buffer (as
        `KVBlockPool.gather_blocks` does), then attention over them -> [Hkv, B, G, D]."""
        outs = []
        for rows, index, mask in groups:
            n, size = rows.stop - rows.start, index.numel()
            keys, values = scratch[:size], scratch[size:2 * size]  # [Hkv * n * nb, bs * D] each
            torch.index_select(k, 0, index, out=keys)
            torch.index_select(v, 0, index, out=values)
            outs.append(decode_attention(self.q[:, rows], keys.view(HKV, n, -1, HEAD_DIM),
                                         values.view(HKV, n, -1, HEAD_DIM), mask))  # [Hkv, n, G, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # rows longest first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", default=None, help="run stage 13's bench and write its steps' row lengths here")
    group.add_argument("--lengths", default=None, help="replay the steps of a --record file (or a JSON list of steps)")
    p.add_argument("--every", type=int, default=8, help="replay every Nth recorded step")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers a step, each with its own pool")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-time-s", type=float, default=0.2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    if a.record:
        steps_seen, result = record_lengths(a.dtype)
        bench = {k: result.get(k) for k in ("dtype", "throughput_tok_s", "decode_step_ms", "step_batch", "kv")}
        Path(a.record).write_text(json.dumps({"bench": bench, "env": result.get("env"), "steps": steps_seen}) + "\n")
        print(f"wrote {len(steps_seen)} steps' lengths to {a.record}")
        return 0
    loaded = json.loads(Path(a.lengths).read_text())
    recorded, bench = (loaded["steps"], loaded.get("bench", {})) if isinstance(loaded, dict) else (loaded, {})
    replayed = [s for s in recorded[:: a.every] if s]
    g = torch.Generator().manual_seed(0)
    # the recording engine's pool (stage 13's BENCH: 280 blocks), else one that holds the largest step
    pool_blocks = (bench.get("kv") or {}).get("num_blocks") or sum(-(-n // BLOCK) for n in max(replayed, key=sum)) + 1
    pools = [tuple(torch.randn(HKV * pool_blocks, BLOCK * HEAD_DIM, generator=g).to(dtype) for _ in range(2))
             for _ in range(a.layers)]  # each layer's K and V
    steps = [Step(s, pool_blocks, dtype, g) for s in replayed]
    scratch = torch.empty(2 * max(st.one[0].index.numel() for st in steps), BLOCK * HEAD_DIM, dtype=dtype)
    k, v = pools[0]
    worst = max(float((st.attend(k, v, st.one, scratch) - st.attend(k, v, st.split, scratch)).abs().max())
                for st in steps)

    forms = {"one": lambda: [st.attend(k, v, st.one, scratch) for st in steps for k, v in pools],
             "split": lambda: [st.attend(k, v, st.split, scratch) for st in steps for k, v in pools]}
    times: dict[str, list[float]] = {"one": [], "split": []}
    for r in range(a.rounds):  # alternated, the order flipped each round
        for name in (("one", "split") if r % 2 == 0 else ("split", "one")):
            times[name].append(median_ms(forms[name], torch.device("cpu"), warmup=1, repeats=3,
                                         min_time_s=a.min_time_s) / (len(steps) * a.layers))
    one, split = statistics.median(times["one"]), statistics.median(times["split"])
    real = sum(st.real_tokens for st in steps)
    fields = {
        "steps_recorded": len(recorded), "steps_replayed": len(steps), "every": a.every, "layers": a.layers,
        "padded_vs_real": sum(st.one_blocks for st in steps) * BLOCK / real,  # one rectangle's keys / the rows' own
        "one_vs_split_blocks": sum(st.one_blocks for st in steps) / sum(st.split_blocks for st in steps),
        "one_ms": one, "split_ms": split, "split_vs_one": split / one, "max_abs_difference": worst,
        "samples_ms": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
    }
    print(f"{len(steps)} steps of {len(recorded)}: one rectangle {one:.3f} ms a layer, split in two {split:.3f} "
          f"({split / one:.2f}x); the rectangle holds {fields['padded_vs_real']:.2f}x the rows' keys, "
          f"{fields['one_vs_split_blocks']:.2f}x the split's blocks")
    if a.json:
        result = {"kind": "decode-padding-bench", "dtype": a.dtype, "threads": torch.get_num_threads(), **fields,
                  "recorded_by": bench, "lengths": replayed}
        write_script_result(a.json, result, "decode_padding_bench.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
