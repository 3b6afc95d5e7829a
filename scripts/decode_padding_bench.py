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
blocks out of stage 13's own `KVBlockPool` (`block_rows`, `gather_blocks`), then
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
from common.config import ModelConfig  # noqa: E402
from common.model import additive_mask, decode_attention  # noqa: E402
from stages.s13_preemption.kv_cache import KVBlockPool  # noqa: E402

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
    """Some of a step's rows as one rectangle: which rows, their blocks' rows in the pool
    (`KVBlockPool.block_rows`), and the length mask [1, n, 1, nb * bs]."""

    rows: slice
    index: torch.Tensor
    mask: torch.Tensor


def kv_pool(num_blocks: int, layers: int, dtype: torch.dtype, g: torch.Generator) -> KVBlockPool:
    """Stage 13's own pool, with SmolLM2-135M's K/V shapes, every block of every layer random."""
    config = ModelConfig(arch="llama", vocab_size=1, hidden_size=HKV * GROUP * HEAD_DIM, num_layers=layers,
                         num_heads=HKV * GROUP, num_kv_heads=HKV, head_dim=HEAD_DIM, intermediate_size=1,
                         max_position_embeddings=8192, norm_eps=1e-5)
    pool = KVBlockPool(config, num_blocks, BLOCK, dtype, torch.device("cpu"))
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


class Step:
    """One recorded step, set up once as a paged stage would hold it: each row's own blocks, distinct,
    from the pool; the block table padded with block 0 up to the rectangle's width (as a fresh
    `BlockTables` row is; a reused row keeps its last session's entries there, masked either way);
    queries as the stages pass them. Rows are sorted longest first, so that a cut in two is a slice."""

    def __init__(self, lengths: list[int], pool: KVBlockPool, g: torch.Generator) -> None:
        self.lengths = torch.tensor(sorted(lengths, reverse=True))  # [B], longest first
        counts = [-(-n // BLOCK) for n in self.lengths.tolist()]
        B, nb = len(counts), counts[0]
        free = torch.randperm(pool.allocator.num_blocks - 1, generator=g) + 1  # block 0 pads the tables
        self.table = torch.zeros(B, nb, dtype=torch.long)  # [B, nb]
        taken = 0
        for i, c in enumerate(counts):  # a longer step than the pool holds reuses blocks: fine for timing
            self.table[i, :c] = free[torch.arange(taken, taken + c) % free.numel()]
            taken += c
        dtype = pool.k[0].dtype
        self.q = torch.randn(B, HKV, GROUP, HEAD_DIM, generator=g).to(dtype).transpose(0, 1)  # [Hkv, B, G, D] view
        cut, self.split_blocks = split_point(counts)
        self.one_blocks, self.real_tokens = B * nb, int(self.lengths.sum())
        self.one = [self.group(pool, 0, B, nb)]
        self.split = [self.group(pool, 0, cut, nb)]
        if cut < B:
            self.split.append(self.group(pool, cut, B, counts[cut]))

    def group(self, pool: KVBlockPool, lo: int, hi: int, nb: int) -> Group:
        """Rows lo..hi-1 as one rectangle of nb blocks each."""
        keys = torch.arange(nb * BLOCK)
        mask = additive_mask((keys < self.lengths[lo:hi, None])[None, :, None, :], pool.k[0].dtype)  # [1, n, 1, nb * bs]
        return Group(slice(lo, hi), pool.block_rows(self.table[lo:hi, :nb].reshape(-1)), mask)

    def attend(self, pool: KVBlockPool, layer: int, groups: list[Group]) -> torch.Tensor:
        """One layer, as `DecodeAttention` does it: each group's blocks copied out of the pool into
        its reused buffer (`gather_blocks`), then attention over them -> [Hkv, B, G, D]."""
        outs = []
        for rows, index, mask in groups:
            n = rows.stop - rows.start
            keys, values = pool.gather_blocks(layer, index)  # [Hkv, n * nb, bs, D]
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
    pool = kv_pool(pool_blocks, a.layers, dtype, g)
    steps = [Step(s, pool, g) for s in replayed]
    worst = max(float((st.attend(pool, 0, st.one) - st.attend(pool, 0, st.split)).abs().max()) for st in steps)

    layers = range(a.layers)
    forms = {"one": lambda: [st.attend(pool, i, st.one) for st in steps for i in layers],
             "split": lambda: [st.attend(pool, i, st.split) for st in steps for i in layers]}
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
