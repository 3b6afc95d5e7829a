"""Decode steps as CUDA graphs: captured once per padded batch size and block-table width, replayed every step.

On a GPU an eager decode step is the host launching a few hundred small kernels one after the
other from Python; the GPU waits between them (on an H200, stage 09's step took 4.3 ms for
under 1 ms of kernels). A CUDA graph records those launches once and replays them with one
call. A graph is fixed: the same kernels on the same memory, of the same shapes. So a decode
step is made to fit one:

- **Buckets.** A step of B sequences runs the graph of the smallest captured batch size >= B
  (1, 2, 4, 8, then steps of 16, as nano-vllm does), and the block tables are padded to the
  smallest captured width >= the longest sequence's blocks (powers of two up to the context
  window), so padding never does more than about twice the real work.
- **Static buffers.** The graph reads only tensors that live as long as it does: token ids,
  positions, the slots new K/V go to, block tables and lengths. A step copies its real values
  into their first B rows; the padded rows point at a scratch block no sequence owns
  (`KVBlockPool.pad_block`), so their K/V writes can never touch a live block.
- **One output.** Every graph writes its logits into the same `[max batch, V]` buffer (vLLM's
  way), and all graphs share one memory pool, captured largest first, so the cost in memory is
  about one largest step, not one per graph. Sampling stays outside, on the first B rows.

On a CPU there is nothing to capture and no launch to save, so an engine there runs eagerly
unless asked (`enforce_eager=False`): then the same buckets, buffers and padding run, and the
function a graph would hold is called eagerly. The stage's tests ask, so every line but
`torch.cuda.graph` and `replay` runs in CI, and what a capture forbids (a host sync, a shape
that depends on data, a tensor made from Python values) must not happen in `forward` on either
device: the tests check it with a dispatch mode that fails on such ops.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import torch

from common.device import to_device
from common.memory import check_fits

from .attention import DecodeAttention, StepAttention

if TYPE_CHECKING:
    from .engine import InferenceEngine


def batch_buckets(max_size: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_size (and max_size itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_size] + list(range(16, max_size + 1, 16))
    return sorted(set(sizes) | {max_size})


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths to capture: powers of two up to max_blocks (and max_blocks itself)."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return widths + [max_blocks]


_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for every capture in this process: a library's per-stream
    workspace (cuBLAS') is then made once, not once per engine."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest size >= n, or None when n is above them all (the step then runs eagerly)."""
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """The engine's decode-only steps, run through padded buckets: replayed CUDA graphs on a GPU,
    the same function called eagerly on a CPU."""

    def __init__(self, engine: "InferenceEngine", max_batch_size: int) -> None:
        self.engine = engine
        pool, device = engine.pool, engine.device
        self.batch_sizes = batch_buckets(max_batch_size)
        # No sequence can hold more blocks than the pool has, nor more than the context window.
        self.widths = width_buckets(min(pool.tables.table.shape[1], pool.allocator.num_blocks))
        G, W = self.batch_sizes[-1], self.widths[-1]
        vocab = engine.model.lm_head_weight.shape[0]
        check_fits(G * vocab * engine.loaded.dtype.itemsize, device, f"the CUDA graphs' logits buffer ({G} rows)",
                   "max_cudagraph_capture_size")  # the largest of the static buffers, [G, V]
        self.ids = torch.zeros((1, G), dtype=torch.long, device=device)  # [1, G]: one packed row, as stage 11
        self.positions = torch.zeros((1, G), dtype=torch.long, device=device)  # [1, G]
        self.slots = torch.zeros(G, dtype=torch.long, device=device)  # [G]: where each row's new K/V go
        self.blocks = torch.zeros((G, W), dtype=torch.long, device=device)  # [G, W]: block tables
        self.lengths = torch.zeros(G, dtype=torch.long, device=device)  # [G]: cached tokens, this one included
        self.rows = torch.arange(G, device=device)  # [G]: every row's logits
        self.logits = torch.empty((G, vocab), dtype=engine.loaded.dtype, device=device)  # [G, V]: every graph's output
        self._pad(0, G)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._kept: list[torch.Tensor] = []  # buffers the graphs use that their owner may replace (see capture)
        self.capture_s = 0.0
        self.pool_bytes = 0
        if device.type == "cuda":
            self.capture()

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: one token of the scratch block, never a live one."""
        pad = self.engine.pool.pad_block
        self.ids[0, start:end] = 0  # any token the embedding has: its row's output is thrown away
        self.positions[0, start:end] = 0
        self.slots[start:end] = pad * self.engine.pool.block_size
        self.blocks[start:end] = pad
        self.lengths[start:end] = 1

    @torch.inference_mode()
    def forward(self, G: int, W: int) -> torch.Tensor:
        """What a graph holds: a decode step over the first G rows of the buffers, block tables W wide.
        Reads only the static buffers, and writes its logits into `self.logits[:G]`. Always in
        inference mode, as the capture runs it: the tensors it writes in place (the pool's gather
        buffer, grown by a warm-up) may be inference tensors, which PyTorch lets no other mode write."""
        attention = StepAttention(DecodeAttention(self.engine.pool, self.slots[:G], self.blocks[:G, :W],
                                                  self.lengths[:G]), None, G)
        # captured=True: one shape per bucket, so SDPA may take cuDNN, planned once (DecoderModel.cudnn_attention_captured)
        out = self.engine.model(self.ids[:, :G], self.positions[:, :G], attention, logits_indices=self.rows[:G],
                                captured=True)  # [G, V]
        self.logits[:G].copy_(out)
        return self.logits[:G]

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (batch, width), largest first, all in one memory pool (the first, largest,
        sizes what the others reuse). Each is run once eagerly first, on the stream it is then
        captured on (PyTorch's advice), so lazy set-up (a library's workspace for that stream,
        the gather buffer growing) is not captured."""
        torch.cuda.synchronize()
        # Every capture empties the allocator's cache on entry (torch.cuda.graph does), so empty it
        # first here too: memory cached before would otherwise be freed inside and count against the graphs.
        gc.collect()
        torch.cuda.empty_cache()
        t0, before = time.perf_counter(), torch.cuda.memory_reserved()
        mempool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        for G in reversed(self.batch_sizes):
            for W in reversed(self.widths):
                with torch.cuda.stream(stream):
                    self.forward(G, W)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream):
                    self.forward(G, W)
                self.graphs[(G, W)] = graph
                # The graph reads and writes the pool's gather buffer where it lay at capture. An
                # eager step that needs a bigger one replaces it (KVBlockPool.gather_blocks): the
                # old one must outlive the graphs, or a replay would write into freed memory.
                if not any(t is self.engine.pool._scratch for t in self._kept):
                    self._kept.append(self.engine.pool._scratch)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved() - before  # the graphs' pool and what their warm-ups grew

    def fits(self, batch: int) -> bool:
        """Whether a decode step of this many sessions has a bucket (every width has one: the
        widest is the whole context window)."""
        return batch <= self.batch_sizes[-1]

    def run(self, ids: list[int], rows: torch.Tensor, new_pos: torch.Tensor, new_slots: torch.Tensor,
            num_blocks: int) -> torch.Tensor:
        """Logits [B, V] of a decode step over B sessions (`fits(B)`). rows: the sessions' rows in
        `pool.tables` [B]; new_pos, new_slots: their new token's [B]; num_blocks: the longest's."""
        B = len(ids)
        G, W = bucket(B, self.batch_sizes), bucket(num_blocks, self.widths)
        tables = self.engine.pool.tables
        self.ids[0, :B].copy_(to_device(ids, torch.long, self.engine.device))
        self.positions[0, :B].copy_(new_pos)
        self.slots[:B].copy_(new_slots)
        self.blocks[:B, :W].copy_(tables.table[rows, :W])
        self.lengths[:B].copy_(tables.lengths[rows])
        if B < G:
            self._pad(B, G)  # a bigger step may have left its rows there: they must not write into live blocks
        if self.graphs:
            self.graphs[(G, W)].replay()
            return self.logits[:B]
        return self.forward(G, W)[:B]

    def close(self) -> None:
        """Free the graphs and their memory pool (the buffers go with this object)."""
        self.graphs.clear()
        self._kept.clear()
