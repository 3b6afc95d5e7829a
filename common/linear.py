"""Projections with their weights packed once for oneDNN, on a CPU in fp32 (and in bf16 where
the CPU has bf16 matmul units); `F.linear` elsewhere.

Why: most of a decode step's time is the model's projections, and on a CPU in fp32 `F.linear`
is MKL's sgemm, which lays the weight out again in its own blocked format on every call.
oneDNN's matmul with the weight reordered into its format ONCE, at load time, did the
decode-sized products about 2x faster on this 2-core AMD EPYC (Zen 4): SmolLM2's projections
for 16 one-token rows in 27 ms instead of 57. At prefill sizes (hundreds to thousands of rows)
the repacking is a small share of the call, and the two paths ran within about 15% of each
other, either way, in micro-benchmarks on different days. It is what
PyTorch's own compiler emits for a linear layer whose weight it may freeze
(`torch.ops.mkldnn._linear_pointwise`, Inductor's CPU freezing pass); we call the op directly,
no compiler and no extension: plain PyTorch.

Packing does not win at a few rows everywhere. There a product does a few multiply-adds per
weight it reads, so its time is mostly the weights' read from memory, and on some CPUs MKL's
path for so few rows (`F.linear`) read them faster than oneDNN's packed one: on a 2-core Xeon
without bf16 units (family/model 6/85) `F.linear` did SmolLM2's products for one and two rows
in 0.7-0.8x the packed time, and 4 to 16 rows in 1.8-2.7x (`stagewise floor-curve --matmul
both`, docs/metrics.md). Which path is faster at which rows is the machine's, so the model
measures it at load, per projection, on its own weights (`rows_for_f_linear`, at most
MAX_UNPACKED_ROWS), and goes through `F.linear` up to that many rows (`linear`'s
`unpacked_rows`). STAGEWISE_F_LINEAR_ROWS=N skips the measurement and takes N rows for every
projection (0: packed at every size), where runs must not differ in which path they took.

The products are the same up to float rounding (summation order differs: a few 1e-6 on fp32
activations), which the parity tests against transformers check every stage against. The op
is private API, so `pack` checks it once per dtype against `F.linear` and everything falls back
to `F.linear` where it is missing or disagrees (and on CUDA, where `F.linear` is the fast path).

bf16 is packed only on a CPU with bf16 matmul units (`cpu_has_bf16_units`: AMX or AVX512-BF16,
or Arm's BF16). There the same repacking counts as much: on a 2-core Xeon with AMX, SmolLM2's
matmuls for one row took 15-22 ms packed against 23-35 through `F.linear`, and for 64 rows 21
against 32. Elsewhere oneDNN emulates bf16 and `F.linear` stays.
"""
from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows the packed layout is tuned for; any number of rows works with it (decode: 1-64, prefill: thousands).
PACK_FOR_ROWS = 16
# `rows_for_f_linear` tries F.linear from one row up to this many: past a few rows a product is no
# longer mostly the weights' read, and the packed layout won wherever it was measured (see above).
MAX_UNPACKED_ROWS = 4
# Weights smaller than this (all layers of one projection together) are not measured and stay
# packed: a cut-off chosen by hand, below which they mostly sit in the caches, where one row's
# product is not the read from memory the measurement is about (and the tiny test model's run
# the same path every time).
MEASURE_MIN_BYTES = 16 << 20
# Of a larger projection, the first layers' weights up to this many bytes are timed: well past a
# CPU's last-level cache, and a bounded cost at load however large the model.
MEASURE_MAX_BYTES = 128 << 20
ROWS_ENV = "STAGEWISE_F_LINEAR_ROWS"  # unset or "auto": measure at load; N: F.linear up to N rows


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None,
           unpacked_rows: int = 0) -> Tensor:
    """`F.linear(x, weight, bias)`: x [..., in] @ weight [out, in]^T -> [..., out], through `packed`
    (the same weight as `pack` returned it) when there is one, unless x has no more than
    `unpacked_rows` rows (`rows_for_f_linear` measures how many; 0: packed at every size)."""
    if packed is None or (unpacked_rows and x.numel() <= unpacked_rows * x.shape[-1]):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor | None:
    """`weight` [out, in] reordered once for oneDNN's matmul, or None where `F.linear` stays."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.bfloat16 and not cpu_has_bf16_units():
        return None
    if not _packing_works(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)


@functools.cache
def _packing_works(dtype: torch.dtype = torch.float32) -> bool:
    """Is the op there, and does it give F.linear's products in `dtype`? Checked once per process."""
    if not torch.backends.mkldnn.is_available():
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa: its sums round apart
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(2, 3, 40, generator=gen).to(dtype)
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
            return bool(torch.allclose(linear(x, w, b, packed).float(), F.linear(x, w, b).float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError):
        return False


def cpu_has_amx() -> bool:
    """Does this CPU have AMX tiles (Intel Xeon since Sapphire Rapids)? They multiply bf16 matrices
    whole tiles at a time; oneDNN's kernels use them, SDPA's bf16 CPU kernel included."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())  # private, so looked up


def cpuinfo() -> dict[str, str]:
    """The first processor's entries in /proc/cpuinfo, keys lower-cased (empty where there is none:
    not Linux, or no permission)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}


@functools.cache
def cpu_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"); "" where it
    names none (Arm) or there is no such file (not Linux). Some choices between two kernels of the
    same result were measured to go one way on AMD's cores and the other on Intel's (common/model.py)."""
    return cpuinfo().get("vendor_id", "")


def cpu_has_bf16_units() -> bool:
    """Does this CPU multiply bf16 in hardware? x86: AVX512-BF16 or AMX tiles (Intel since Cooper
    Lake / Sapphire Rapids, AMD since Zen 4); Arm: the BF16 extension (Graviton 3, Neoverse V1+).

    Why it matters: there oneDNN runs a bf16 matmul at twice fp32's rate or more, on half the
    bytes; elsewhere bf16 is emulated and slower than fp32. (oneDNN's own "bf16 supported" check
    on x86 says yes to any AVX-512 CPU, emulation included, so it is asked on Arm only.)"""
    if cpu_has_amx() or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():  # private, so looked up
        return True
    if platform.machine().lower() in ("aarch64", "arm64") and torch.backends.mkldnn.is_available():
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without the op: no bf16 we can count on
            return False
    return False


Weights = list[tuple[Tensor, Tensor | None, Tensor | None]]  # (weight [out, in], bias, packed) per layer


def f_linear_rows_setting(environ: dict[str, str] | None = None) -> int | None:
    """STAGEWISE_F_LINEAR_ROWS: None to measure at load (unset, empty or "auto"), else the rows
    (0 to MAX_UNPACKED_ROWS) every projection takes `F.linear` for."""
    value = (os.environ if environ is None else environ).get(ROWS_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if not value.isdigit() or int(value) > MAX_UNPACKED_ROWS:
        raise ValueError(f"{ROWS_ENV} must be auto or a whole number from 0 to {MAX_UNPACKED_ROWS}, got {value!r}")
    return int(value)


@torch.inference_mode()
def rows_for_f_linear(groups: dict[str, Weights], max_rows: int = MAX_UNPACKED_ROWS) -> dict[str, int]:
    """Per projection (all layers' weights of one name), up to how many rows `F.linear` multiplies
    by them faster than their packed copies, on this machine, now: 0 where packed wins at one row.

    Measured as a decode step runs them: every group in turn over its layers (the first ones,
    up to MEASURE_MAX_BYTES), so that each read comes from memory, not from a cache the previous
    pass left warm. Six passes for each row count, paths alternating (packed, F.linear, F.linear,
    packed, packed, F.linear: a drifting machine slows both alike); each path's first pass warms
    it up, the faster of its other two counts. A group takes F.linear at `rows` only where it was
    at least 10% faster there and at every row below; inside that margin the packed weights stay.
    Rows stop at the first count where every group lost (SmolLM2 in fp32 on that Xeon: rows 1
    to 4, under a second at load; where packed wins at one row, six passes). Groups without
    packed weights, or under MEASURE_MIN_BYTES, get 0."""
    rows_for = {name: 0 for name in groups}
    live = {name: _first_bytes(ws, MEASURE_MAX_BYTES) for name, ws in groups.items()
            if ws and all(p is not None for _, _, p in ws)
            and sum(w.nbytes for w, _, _ in ws) >= MEASURE_MIN_BYTES}
    gen = torch.Generator().manual_seed(0)
    for rows in range(1, max_rows + 1):
        if not live:
            break
        inputs = {name: [torch.randn(rows, w.shape[1], generator=gen).to(w.dtype) for w, _, _ in ws]
                  for name, ws in live.items()}
        times: dict[tuple[str, bool], list[float]] = {(n, p): [] for n in live for p in (True, False)}
        for packed in (True, False, False, True, True, False):
            for name, ws in live.items():
                start = time.perf_counter()
                for x, (w, b, p) in zip(inputs[name], ws):
                    linear(x, w, b, p if packed else None)
                times[name, packed].append(time.perf_counter() - start)
        for name in list(live):
            if min(times[name, False][1:]) < 0.9 * min(times[name, True][1:]):  # first passes: warm-up
                rows_for[name] = rows
            else:
                del live[name]
    return rows_for


def _first_bytes(ws: Weights, limit: int) -> Weights:
    """The first layers' weights of `ws`, as many as it takes to reach `limit` bytes (or all)."""
    total = 0
    for i, (w, _, _) in enumerate(ws):
        total += w.nbytes
        if total >= limit:
            return ws[:i + 1]
    return ws
