"""Decode attention over one K/V rectangle padded to the step's longest row, against the rows split
in two by length (each group padded to its own longest): what the padding costs on the lengths of
stage 13's own workload, and whether a second call would buy it back.

    python scripts/decode_padding_bench.py --dtype bfloat16 --record LENGTHS
    python scripts/decode_padding_bench.py --dtype bfloat16 --lengths LENGTHS --json FILE

`--record` runs stage 13's bench once (its `BENCH` workload: 64 chat prompts, up to 512 new
tokens, a KV pool for 8 at their worst, so requests of very different lengths decode side by side)
and keeps every decode step's row lengths. The replay runs in a process of its own (in the bench's
own process both forms timed several percent off a fresh process's figures): for every
`--every`-th step, one layer of decode attention both ways, alternated: copy the rows' blocks out
of a pool laid out as `KVBlockPool`'s (`index_select`), then `common.model.decode_attention`.
SmolLM2-135M's shapes: 3 KV heads, 3 query heads each, head size 64, blocks of 16 tokens.
Reported: each form's median over rounds of its ms a layer, per step, and how much smaller the
split's rectangles are.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.bench.envinfo import collect_env  # noqa: E402
from common.bench.floor import median_ms  # noqa: E402
from common.model import additive_mask, decode_attention  # noqa: E402

HKV, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16


def record_lengths(dtype: str) -> tuple[list[list[int]], dict]:
    """Stage 13's bench, once: every decode step's row lengths, and the bench's result."""
    import stages.s13_preemption.attention as attention
    from common.bench.harness import run_stage_bench

    steps: list[list[int]] = []
    init = attention.DecodeAttention.__init__

    def recording(self, pool, new_slots, blocks, lengths) -> None:  # the same init, and its lengths kept
        init(self, pool, new_slots, blocks, lengths)
        steps.append(lengths.tolist())

    attention.DecodeAttention.__init__ = recording
    try:
        result = run_stage_bench("stages.s13_preemption", ["--dtype", dtype, "--warmup-runs", "0", "--repeat-runs", "1"])
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


class Step:
    """One recorded step, set up once: its queries, its rows' blocks in a pool, both forms' masks."""

    def __init__(self, lengths: list[int], pool_blocks: int, dtype: torch.dtype, g: torch.Generator) -> None:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # longest first
        self.lengths = torch.tensor([lengths[i] for i in order])  # [B]
        counts = [-(-n // BLOCK) for n in self.lengths.tolist()]
        B, nb = len(counts), counts[0]
        self.q = torch.randn(HKV, B, GROUP, HEAD_DIM, generator=g).to(dtype)  # [Hkv, B, G, D]
        self.blocks = torch.stack([torch.randperm(pool_blocks, generator=g)[:nb] for _ in range(B)])  # [B, nb]
        cut, self.split_blocks = split_point(counts)
        self.one_blocks, self.real_tokens = B * nb, int(self.lengths.sum())
        self.groups = [self.group(0, B, nb, pool_blocks, dtype)]  # one rectangle
        self.split = [self.group(0, cut, nb, pool_blocks, dtype)]
        if cut < B:
            self.split.append(self.group(cut, B, counts[cut], pool_blocks, dtype))

    def group(self, lo: int, hi: int, nb: int, pool_blocks: int, dtype: torch.dtype) -> tuple:
        """Rows lo..hi-1 as one rectangle of nb blocks: (rows, gather index [Hkv * n * nb], mask)."""
        heads = torch.arange(HKV) * (pool_blocks + 1)  # [Hkv]: where each head's blocks start
        index = (heads[:, None] + self.blocks[lo:hi, :nb].reshape(-1)[None, :]).reshape(-1)
        keys = torch.arange(nb * BLOCK)
        mask = additive_mask((keys < self.lengths[lo:hi, None])[None, :, None, :], dtype)  # [1, n, 1, nb * bs]
        return slice(lo, hi), index, mask

    def attend(self, k: torch.Tensor, v: torch.Tensor, groups: list) -> torch.Tensor:
        """One layer: each group's blocks copied out of the pool, then attention over them."""
        outs = []
        for rows, index, mask in groups:
            n = rows.stop - rows.start
            keys = torch.index_select(k, 0, index).view(HKV, n, -1, HEAD_DIM)  # [Hkv, n, nb * bs, D]
            values = torch.index_select(v, 0, index).view(HKV, n, -1, HEAD_DIM)
            outs.append(decode_attention(self.q[:, rows], keys, values, mask))  # [Hkv, n, G, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [Hkv, B, G, D]: rows longest first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", default=None, help="run stage 13's bench and write its steps' row lengths here")
    group.add_argument("--lengths", default=None, help="replay the steps of a --record file (or a JSON list of steps)")
    p.add_argument("--every", type=int, default=8, help="replay every Nth recorded step")
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
    pool_blocks = max(-(-max(s) // BLOCK) for s in replayed) * max(len(s) for s in replayed)
    k, v = (torch.randn(HKV * (pool_blocks + 1), BLOCK * HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    steps = [Step(s, pool_blocks, dtype, g) for s in replayed]
    worst = max(float((st.attend(k, v, st.groups) - st.attend(k, v, st.split)).abs().max()) for st in steps)

    forms = {"one": lambda: [st.attend(k, v, st.groups) for st in steps],
             "split": lambda: [st.attend(k, v, st.split) for st in steps]}
    times: dict[str, list[float]] = {"one": [], "split": []}
    for r in range(a.rounds):  # alternated, the order flipped each round
        for name in (("one", "split") if r % 2 == 0 else ("split", "one")):
            times[name].append(median_ms(forms[name], torch.device("cpu"), warmup=1, repeats=3,
                                         min_time_s=a.min_time_s) / len(steps))
    one, split = statistics.median(times["one"]), statistics.median(times["split"])
    real = sum(st.real_tokens for st in steps)
    fields = {
        "steps_recorded": len(recorded), "steps_replayed": len(steps), "every": a.every,
        "padded_vs_real": sum(st.one_blocks for st in steps) * BLOCK / real,  # one rectangle's keys / the rows' own
        "one_vs_split_blocks": sum(st.one_blocks for st in steps) / sum(st.split_blocks for st in steps),
        "one_ms": one, "split_ms": split, "split_vs_one": split / one, "max_abs_difference": worst,
        "samples_ms": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
    }
    print(f"{len(steps)} steps of {len(recorded)}: one rectangle {one:.3f} ms a layer, split in two {split:.3f} "
          f"({split / one:.2f}x); the rectangle holds {fields['padded_vs_real']:.2f}x the rows' keys, "
          f"{fields['one_vs_split_blocks']:.2f}x the split's blocks")
    if a.json:
        out = {"kind": "decode-padding-bench", "dtype": a.dtype, "threads": torch.get_num_threads(), **fields,
               "recorded_by": bench, "lengths": replayed,
               "command": shlex.join(["python", "scripts/decode_padding_bench.py", *(argv or sys.argv[1:])]),
               "env": collect_env("cpu")}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
