"""The ranks of a tensor-parallel engine on torch.distributed: how they come up, the
collectives the split model calls, and how rank 0 leads the others step by step.

Every rank holds a share of every layer (sharding.py) and a KV pool for its own KV heads. One
scheduler runs on rank 0; for every step it sends the other ranks what the forward needs (token
ids, positions, slots, block tables, lengths: a few kilobytes), and every rank runs the same
forward. That is vLLM's way (its executor sends each step's plan to the workers, through a
shared-memory queue, or `broadcast_object_list` where it has none) and nano-vllm's (through
shared memory); SGLang and mini-sglang instead send every rank the incoming requests and run a
scheduler on each. One scheduler keeps stage 13's untouched and the other ranks stateless: they
never see a request, so there is nothing on them to keep in step. The step goes with one
`broadcast_object_list`, torch.distributed's own, the same on gloo and NCCL. The ranks come up either under `torchrun`
(any number of machines: each rank runs the same command) or, launched as one process, as
`tensor_parallel_size - 1` processes that rank 0 starts itself (`torch.multiprocessing`, as
vLLM's multiprocessing executor and nano-vllm do) with the environment torchrun would give them.
gloo between CPU processes, NCCL between GPUs.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.profiler import record_function

from common.config import ModelConfig

TIMEOUT = datetime.timedelta(seconds=60)  # a collective waits this long for a rank that died
STOP = "stop"
_ACTIVE: "TensorParallel | None" = None  # the process group's owner in this process


class TensorParallel:
    """This process's place among the ranks, and the collectives the sharded model calls."""

    def __init__(self, size: int, config: ModelConfig, device: torch.device) -> None:
        if int(size) < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {size}")
        size = int(size)
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):  # every rank: whole heads, equal slices
            if getattr(config, name) % size:
                raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({getattr(config, name)})")
        if device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size}: more ranks than GPUs ({torch.cuda.device_count()})")
        self.size = size
        self.rank = int(os.environ.get("RANK", 0)) if size > 1 else 0
        self.workers: list[Any] = []
        self.bytes_loaded = 0  # of the checkpoint, by this rank (sharding.py)
        self._threads: int | None = None  # the process's intra-op threads before the ranks split them
        # The collectives this rank has run and their bytes (profile-decode reads them; a CUDA
        # graph's replays run its all-reduces without passing here, so on CUDA only eager steps count).
        self.counts: Counter[str] = Counter()
        if size > 1:
            self._join(device)

    @property
    def launched_by_torchrun(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("STAGEWISE_TP_WORKER") == "1"

    def _join(self, device: torch.device) -> None:
        """Join the process group: as one of torchrun's ranks, or as rank 0 of a launch that
        starts its own workers (`spawn_workers`, called by the engine once it knows their job)."""
        if self.launched_by_torchrun:
            if int(os.environ.get("WORLD_SIZE", 0)) != self.size:
                raise ValueError(f"tensor_parallel_size {self.size}, but the launch has {os.environ.get('WORLD_SIZE')} ranks")
        else:  # rank 0 of its own launch: where the others will find it
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                              WORLD_SIZE=str(self.size))
            self.rank = 0
        global _ACTIVE
        if _ACTIVE is not None:  # one group per process: a new engine ends the one before (a bench makes one a run)
            _ACTIVE.close()
        _ACTIVE = self
        self.backend = "nccl" if device.type == "cuda" else "gloo"

    def start(self, worker_job: dict | None) -> None:
        """Start the other ranks (when launched alone) and form the group; they load, shard and follow."""
        if self.size == 1:
            return
        if self.backend == "gloo":  # CPU ranks share this machine's cores: each takes its part of the threads
            self._threads = torch.get_num_threads()
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))  # torchrun's ranks on this machine
            torch.set_num_threads(max(1, self._threads // local_ranks))
        if not self.launched_by_torchrun:
            ctx = mp.get_context("spawn")
            env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
            env["LOCAL_WORLD_SIZE"] = env["WORLD_SIZE"]  # all on this machine
            job = {**worker_job, "threads": self._threads}  # the whole count: each rank takes its part
            for rank in range(1, self.size):
                p = ctx.Process(target=_worker_main, args=({**env, "RANK": str(rank)}, job), daemon=True)
                p.start()
                self.workers.append(p)
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.size, timeout=TIMEOUT)

    # ---- the collectives the model calls (identity at size 1) -------------------------------

    def all_reduce(self, t: Tensor) -> Tensor:
        """Every rank's `t` summed, in place, on every rank."""
        if self.size > 1:
            self.counts["all_reduce"] += 1
            self.counts["all_reduce_bytes"] += t.numel() * t.element_size()
            with record_function("tensor_parallel::all_reduce"):  # a profile's span: the wait for the others included
                dist.all_reduce(t)
        return t

    def gather_last(self, t: Tensor) -> Tensor:
        """Every rank's slice of the last dimension, joined in rank order on rank 0, the rank that
        samples; every other rank sends its slice and keeps it (nobody else needs the whole)."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        self.counts["gather"] += 1
        self.counts["gather_bytes"] += t.numel() * t.element_size() * self.size
        with record_function("tensor_parallel::gather"):
            dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else t

    def logits_width(self, vocab: int) -> int:
        """The logits this rank's forward returns: the whole vocabulary on rank 0, its slice elsewhere."""
        return vocab if self.rank == 0 else -(-vocab // self.size)

    # ---- rank 0 leads, the others follow ----------------------------------------------------

    def send(self, message: Any) -> None:
        """Rank 0: what every other rank must run now (a step's inputs, or STOP)."""
        if self.size > 1:
            for p in self.workers:
                if not p.is_alive():
                    raise RuntimeError(f"tensor parallel: rank {self.workers.index(p) + 1} died "
                                       f"(exit code {p.exitcode})")
            self.counts["broadcast"] += 1
            self.counts["broadcast_bytes"] += len(pickle.dumps(message))  # what the broadcast pickles and sends
            with record_function("tensor_parallel::broadcast"):
                dist.broadcast_object_list([message], src=0)

    def follow(self, run: Callable[[Any], None]) -> None:
        """The other ranks: run every step rank 0 sends, until it sends STOP (or dies)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] == STOP:
                return
            run(box[0])

    def close(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if self.size > 1 and dist.is_initialized():
            if self.rank == 0:
                try:
                    self.send(STOP)
                except (RuntimeError, OSError):
                    pass  # a rank died: there is nobody left to stop
            dist.destroy_process_group()
        for p in self.workers:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.workers = []
        if self._threads:
            torch.set_num_threads(self._threads)  # the process's threads as they were
            self._threads = None


# ----------------------------------------------------------------------------- the other ranks

def rank_device(device: str) -> str:
    """This rank's device: under torchrun (or a launch of our own) a GPU rank takes its local
    rank's GPU; a CPU is shared."""
    if device.startswith("cuda") and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(env: dict[str, str], job: dict) -> None:
    """A rank that rank 0 started: the environment torchrun would give it, then the same engine,
    which follows rank 0's steps inside its constructor and returns when rank 0 closes."""
    os.environ.update(env, STAGEWISE_TP_WORKER="1", LOCAL_RANK=env["RANK"])
    import importlib

    from common.loader import load_model

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    loaded = load_model(job["model"], device=rank_device(job["device"]), dtype=job["dtype"], weights=False)
    engine_cls = importlib.import_module(job["package"]).InferenceEngine
    engine_cls(loaded, **job["kwargs"])
