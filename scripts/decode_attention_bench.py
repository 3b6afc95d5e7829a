"""SDPA against `common.model.written_out_attention` (what `decode_attention` runs in bf16 on a CPU
over a large rectangle), over decode-shaped K/V rectangles, in one process, alternated: the
micro-benchmark behind `DECODE_MATMUL_MIN_KEYS`.

    python scripts/decode_attention_bench.py --dtype bfloat16 --json FILE

SmolLM2-135M's shapes: 3 KV heads, 3 query heads each, head size 64. For each rectangle (rows x
keys), each form's median over rounds of its median ms a call (one call is one layer of a decode
step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.bench.floor import median_ms  # noqa: E402
from common.bench.results import write_script_result  # noqa: E402
from common.model import written_out_attention  # noqa: E402

SHAPES = [(4, 80), (8, 80), (16, 80), (32, 80), (64, 80), (4, 320), (16, 320), (64, 320), (16, 1024), (64, 1024),
          (64, 512), (32, 1024), (64, 2048)]  # the last three: where a CPU with AMX crosses over


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-time-s", type=float, default=0.2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    Hkv, G, D = 3, 3, 64
    rows = []
    for B, L in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, Hkv, G, D, generator=g).to(dtype).transpose(0, 1)  # [Hkv, B, G, D], as the stages pass it
        k, v = (torch.randn(Hkv, B, L, D, generator=g).to(dtype) for _ in range(2))
        mask = torch.zeros(1, B, 1, L, dtype=dtype)

        forms = (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                 ("written_out", lambda: written_out_attention(q, k, v, mask)))
        times: dict[str, list[float]] = {"sdpa": [], "written_out": []}
        for r in range(a.rounds):  # alternated, the order flipped each round
            for name, fn in forms[:: 1 if r % 2 == 0 else -1]:
                times[name].append(median_ms(fn, torch.device("cpu"), warmup=5, repeats=10, min_time_s=a.min_time_s))
        s, w = statistics.median(times["sdpa"]), statistics.median(times["written_out"])
        rows.append({"rows": B, "keys": L, "sdpa_ms": s, "written_out_ms": w, "written_out_vs_sdpa": w / s,
                     "samples_ms": {name: [round(t, 4) for t in ts] for name, ts in times.items()}})
        print(f"{B:4d} rows x {L:5d} keys  SDPA {s:7.3f} ms  written out {w:7.3f} ms  {w / s:5.2f}x")
    if a.json:
        result = {"kind": "decode-attention-bench", "dtype": a.dtype, "threads": torch.get_num_threads(), "shapes": rows}
        write_script_result(a.json, result, "decode_attention_bench.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
