"""The machine's floor for a decode step: the model's own matmuls alone, for B one-token rows.

A decode step of any stage runs, for every layer, the same few projections on a [B, hidden]
batch (Llama: qkv, o, gate_up, down; GPT-2: attn, attn_proj, fc, mlp_proj, with biases), then the
lm_head projection, each through `common.linear.linear` with the weight the model packed for it
(oneDNN on a CPU in fp32, `F.linear` elsewhere and at the few rows where it measured faster at
load): the floor makes the same calls. Everything else
a step does -- attention over the cache, norms, RoPE, sampling, the scheduler's Python -- comes
on top. So the time of those matmuls alone, on the same
weights, dtype and device, in the same process, is a floor no stage can beat; `x floor`
(decode step / floor) says how much of a step is overhead a better engine could still remove.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from common.linear import linear
from common.memory import kv_bytes
from common.sampling import greedy_pick
from common.threads import set_intra_op_threads


def decode_batch(max_batch_size: int, num_requests: int) -> int:
    """The batch the decode steps run at: as many rows as fit, or as there are requests."""
    return max(1, min(int(max_batch_size), int(num_requests)))


def decode_matmuls(model: torch.nn.Module) -> list[tuple[Tensor, Tensor | None, Tensor | None, int]]:
    """(weight [out, in], bias or None, packed weight or None, rows up to which `F.linear` is used
    instead) of every projection one decode step makes, in order (see `Projections` in
    common/model.py): the arguments the step hands `common.linear.linear`."""
    out: list[tuple[Tensor, Tensor | None, Tensor | None, int]] = []
    for layer in model.layers:
        out += [(*layer.projection(n), layer.packed.get(n), layer.unpacked_rows.get(n, 0)) for n in layer.PROJECTIONS]
    out.append((model.lm_head_weight, None, model.lm_head_packed, model.lm_head_unpacked_rows))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def matmul_floor_ms(model: torch.nn.Module, batch: int, *, warmup: int = 5, repeats: int = 30,
                    min_time_s: float = 0.0, lm_head_rows: int | None = None, packed: bool = True) -> float:
    """Median time (ms) of one decode step's matmuls alone, on [batch, in] inputs of the model's
    dtype and device. Inputs are made once, outside the timing; each matmul gets its own input
    (as in the decoder, where every projection reads a fresh activation). At least `repeats`
    timed steps, more until `min_time_s` has passed (a tiny model's step is too short for 30).
    `lm_head_rows`: rows of the last product, the lm_head, where they differ from `batch` (a
    prefill of `batch` tokens projects only its last row onto the vocabulary). The model's own
    products are packed where it packed them, `F.linear` up to the rows it measured faster so at
    load; `packed=False` times `F.linear` on the same weights at every batch (common/linear.py):
    which of the two is faster at which batch is the machine's (`stagewise floor-curve --matmul`)."""
    if batch < 1 or repeats < 1 or (lm_head_rows is not None and lm_head_rows < 1):
        raise ValueError("batch, repeats and lm_head_rows: must be >= 1")
    mats = decode_matmuls(model)
    weight = mats[0][0]
    device, dtype = weight.device, weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = [batch] * (len(mats) - 1) + [lm_head_rows or batch]
    inputs = [torch.randn(n, w.shape[1], generator=gen).to(device=device, dtype=dtype) for n, (w, *_) in zip(rows, mats)]

    def step() -> None:
        for x, (w, b, pw, unpacked_rows) in zip(inputs, mats):
            linear(x, w, b, pw if packed else None, unpacked_rows)

    return median_ms(step, device, warmup=warmup, repeats=repeats, min_time_s=min_time_s)


def median_ms(step: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
               min_time_s: float = 0.0) -> float:
    """Median wall time (ms) of `step()` after `warmup` untimed calls: at least `repeats` timed
    calls, more until `min_time_s` has passed (at most 100x `repeats`); each waits for the device."""
    for _ in range(warmup):
        step()
    _sync(device)
    times: list[float] = []
    deadline = time.perf_counter() + min_time_s
    while len(times) < repeats or (time.perf_counter() < deadline and len(times) < 100 * repeats):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000.0)
    return float(statistics.median(times))


def kv_bytes_per_step(config: Any, batch: int, context: float, element_size: int) -> int:
    """Bytes of K and V a decode step must read at the least: `context` cached tokens for each of
    `batch` rows, in every layer, read once. Paged engines read more (whole blocks, padded to the
    longest row, and the copy they gather into); this counts only what attention needs."""
    return int(kv_bytes(config, batch * context, element_size))


@torch.inference_mode()
def read_floor_ms(nbytes: int, dtype: torch.dtype, device: torch.device, *, repeats: int = 20) -> float:
    """Median time (ms) to read `nbytes` once, at the speed this machine streams memory: a sum over
    a buffer of that size, on the same threads the engine uses. At decode sizes the buffer is larger
    than the caches (a step's K/V for 16 rows of ~200 SmolLM2 tokens: ~130 MB), so it comes from
    memory, as the K/V of 30 layers do; for a tiny model it stays in cache and the figure is cache speed."""
    if nbytes < 1 or repeats < 1:
        raise ValueError("nbytes and repeats: must be >= 1")
    element = torch.empty((), dtype=dtype).element_size()
    buf = torch.ones(max(1, nbytes // element), dtype=dtype, device=device)
    return median_ms(buf.sum, device, warmup=2, repeats=repeats)


def _no_attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """An attention that reads no K/V: each query row comes back as its own output ([B, T, Hq, D]),
    in a tensor of its own as every attention's output is. (q itself is a strided view into the
    q/k/v projection: the output projection would then see strided rows, and on a CPU in bf16
    `F.linear` runs them as a batched matmul over a copy of the weight for every row.)"""
    return q.contiguous()


@torch.inference_mode()
def attention_free_ms(model: torch.nn.Module, batch: int, *, warmup: int = 5, repeats: int = 30,
                      min_time_s: float = 0.0) -> float:
    """Median time (ms) of the model's whole one-token forward for `batch` rows with attention
    replaced by a no-op, and the greedy pick of every row's next token: the embedding, norms, RoPE,
    activations, residual adds and matmuls of a decode step, op by op as eager PyTorch runs them.

    Why: the matmul floor leaves out every other op of the forward, and `read_floor_ms` the K/V.
    A stage's step runs both, one after the other, so this plus reading the step's K/V once is the
    least any attention design can reach with this model's forward; what a step costs above that
    sum is its attention's (and its engine's) own."""
    device = model.lm_head_weight.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).to(device)  # [B, 1]
    positions = torch.ones((batch, 1), dtype=torch.long, device=device)  # [B, 1]
    first = torch.zeros(batch, dtype=torch.long, device=device)  # [B]: the only token of each row

    def step() -> None:
        greedy_pick(model(ids, positions, _no_attention, logits_indices=first).float())  # [B], as sample_tokens picks

    return median_ms(step, device, warmup=warmup, repeats=repeats, min_time_s=min_time_s)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads, then give back the count it found (no call at
    all where the count is already `n`: `common.threads.set_intra_op_threads` says why)."""
    before = torch.get_num_threads()
    set_intra_op_threads(n)
    try:
        yield
    finally:
        set_intra_op_threads(before)


class FloorSampler:
    """Samples the floor after every timed run, so that it sees the machine the runs saw.

    A shared 2-core VM drifts: the same matmuls took 69 to 115 ms within one minute here. A floor
    measured once, after all the runs, can land in a slower or faster minute than the runs did;
    the median of one sample per run tracks them."""

    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        self.model, self.batch = model, int(batch)
        self.samples_ms: list[float] = []
        # The machine's floor: with the threads this process had before any engine. A tensor-
        # parallel engine on a CPU gives each rank a share of them (stage 14), rank 0 included.
        self.threads = torch.get_num_threads()

    def __call__(self) -> None:
        with threads(self.threads):
            self.samples_ms.append(matmul_floor_ms(self.model, self.batch, min_time_s=0.3))

    def fields(self) -> dict[str, Any]:
        if not self.samples_ms:
            self()
        return {"floor_ms": float(statistics.median(self.samples_ms)), "floor_batch": self.batch,
                "floor_samples_ms": [round(s, 3) for s in self.samples_ms],
                "matmul_unpacked_rows": self.model.unpacked_rows}


def with_x_floor(result: dict, floor: dict | None) -> dict:
    """Add `floor_ms`, `floor_batch` and `x_floor` (= decode_step_ms / floor_ms) to `result`."""
    if not floor:
        return result
    result.update(floor)
    step, base = result.get("decode_step_ms"), floor.get("floor_ms")
    result["x_floor"] = float(step) / base if step is not None and base else None
    return result
