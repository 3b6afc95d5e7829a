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

import dataclasses
import datetime
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.profiler import record_function

from common.config import ModelConfig
from common.requests import int_knob
from common.threads import set_intra_op_threads

START_TIMEOUT = datetime.timedelta(minutes=10)  # forming the group: every rank loads its share first
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the step broadcast: a follower waits as long as rank 0 idles
STOP = "stop"
_ACTIVE: "TensorParallel | None" = None  # the process group's owner in this process


def collective_timeout() -> datetime.timedelta:
    """How long a collective of the model waits for a rank that died: a minute, or what
    STAGEWISE_TP_TIMEOUT_S says (the tests shorten it)."""
    return datetime.timedelta(seconds=float(os.environ.get("STAGEWISE_TP_TIMEOUT_S", 60)))


@dataclass
class Step:
    """One step's forward as every rank runs it: the packed row's token ids and positions [T]
    (decode rows first), each decode row's slot [B], block table [B, nb] and length [B], each
    prompt chunk's slots [S], span and blocks, and the rows whose logits are kept. Rank 0 builds
    it from its sessions; the other ranks get a copy (`send`) and never see a session."""

    ids: list[int]
    positions: torch.Tensor
    rows: list[int]
    num_decode: int
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prefill: tuple[torch.Tensor, list[tuple[int, int, int]], list[list[int]]] | None = None
    graph: bool = False  # decode only, in a captured bucket

    def cpu(self) -> "Step":
        """A copy to send: its tensors on the host."""
        move = lambda group: None if group is None else tuple(t.cpu() if torch.is_tensor(t) else t for t in group)  # noqa: E731
        return dataclasses.replace(self, positions=self.positions.cpu(), decode=move(self.decode),
                                   prefill=move(self.prefill))


class TensorParallel:
    """This process's place among the ranks, and the collectives the sharded model calls."""

    def __init__(self, size: int, config: ModelConfig, device: torch.device) -> None:
        size = int_knob("tensor_parallel_size", size, 1)
        sizes = (config.num_heads, config.num_kv_heads, config.intermediate_size)  # every rank: whole heads, equal slices
        if any(n % size for n in sizes):
            fits = [k for k in range(1, config.num_kv_heads + 1) if not any(n % k for n in sizes)]
            name = next(name for name, n in zip(("num_heads", "num_kv_heads", "intermediate_size"), sizes) if n % size)
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({getattr(config, name)}); "
                             f"this model splits {' or '.join(map(str, fits))} ways")
        self.size = size
        self.rank = int(os.environ.get("RANK", 0)) if size > 1 else 0
        if device.type == "cuda" and size > 1:
            if self.local_ranks > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {size}: more ranks than GPUs on this machine "
                                 f"({self.local_ranks} > {torch.cuda.device_count()})")
            if not self.launched_by_torchrun and (device.index or 0) != 0:
                raise ValueError(f"tensor_parallel_size {size}: the ranks take cuda:0 to cuda:{size - 1}; "
                                 f"load the model on cuda:0, not {device}")
        self.workers: list[Any] = []
        self.bytes_loaded = 0  # of the checkpoint, by this rank (sharding.py)
        self.broken: str | None = None  # why the ranks were stopped half-way (abort); every step then fails
        self._threads: int | None = None  # the process's intra-op threads before the ranks split them
        self._group = False  # this object made the process group (and alone may end it)
        # The collectives this rank has run and their bytes (profile-decode reads them; a CUDA
        # graph's replays run its all-reduces without passing here, so on CUDA only eager steps count).
        self.counts: Counter[str] = Counter()
        if size > 1:
            self._join(device)

    @property
    def launched_by_torchrun(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("STAGEWISE_TP_WORKER") == "1"

    @property
    def local_ranks(self) -> int:
        """The ranks on this machine: torchrun's count here, or every rank of a launch of our own."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.size)) if self.launched_by_torchrun else self.size

    def _join(self, device: torch.device) -> None:
        """Find the process group: as one of torchrun's ranks, or as rank 0 of a launch that
        starts its own ranks (`start`, called by the engine once it knows their job)."""
        if self.launched_by_torchrun:
            if int(os.environ.get("WORLD_SIZE", 0)) != self.size:
                raise ValueError(f"tensor_parallel_size {self.size}, but the launch has {os.environ.get('WORLD_SIZE')} ranks")
        else:  # rank 0 of its own launch: where the others will find it
            os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE=str(self.size))  # the port: see _store
            self.rank = 0
        global _ACTIVE
        if _ACTIVE is not None:  # one group per process: a new engine ends the one before (a bench makes one a run)
            _ACTIVE.close()
        _ACTIVE = self
        self.backend = "nccl" if device.type == "cuda" else "gloo"

    def start(self, worker_job: dict | None) -> None:
        """Start the other ranks (when launched alone) and form the group; they load, shard and follow.
        If the group does not form, the ranks this process started are stopped, the process is
        left as it was (its threads, no group) and the error says which rank died, if one did."""
        if self.size == 1:
            return
        try:
            self._start(worker_job)
        except BaseException as exc:
            why = None
            if self.broken is None:  # stop the ranks it started; say which one died, if one did
                why = self.failure()
                self.abort(f"{why} while the group formed" if why else
                           f"tensor parallel: the group did not form ({type(exc).__name__}: {exc})")
            self.close()
            if why:
                raise RuntimeError(self.broken) from exc
            raise

    def _start(self, worker_job: dict | None) -> None:
        """start() without its clean-up: split the threads, start the ranks, form the groups."""
        if self.backend == "gloo":  # CPU ranks share this machine's cores: each takes its part of the threads
            self._threads = torch.get_num_threads()
            set_intra_op_threads(max(1, self._threads // self.local_ranks))  # no call if it stays (common/threads.py)
        store, timeout = None, START_TIMEOUT  # under torchrun: its environment's rendezvous (env://)
        if not self.launched_by_torchrun:
            # Rank 0 holds the rendezvous store, and forms the group only once every rank it
            # started has checked in: a rank that dies on its way up (an import error; a script
            # without `if __name__ == "__main__":`, which spawn runs again in the child) is an
            # error now, not a wait of START_TIMEOUT.
            store = self._store(is_master=True)
            ctx = mp.get_context("spawn")
            env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
            env["LOCAL_WORLD_SIZE"] = env["WORLD_SIZE"]  # all on this machine
            job = {**worker_job, "threads": self._threads}  # the whole count: each rank takes its part
            for rank in range(1, self.size):
                p = ctx.Process(target=_worker_main, args=({**env, "RANK": str(rank)}, job), daemon=True)
                p.start()
                self.workers.append(p)
            self._wait_for_ranks(store)
            # Every rank is in, and it only has init_process_group left to run: a rank that dies
            # now is a timeout of the collectives' length, not of START_TIMEOUT.
            timeout = collective_timeout()
        elif os.environ.get("STAGEWISE_TP_WORKER") == "1":  # a rank that rank 0 started: check in
            store = self._store(is_master=False)
            store.set(f"stagewise/up/{self.rank}", "1")
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size, timeout=timeout)
        self._group = True
        # Two groups of the same ranks, for two kinds of waiting. The model's collectives give up
        # on a rank that died after a minute. The steps go over a gloo group of their own (vLLM's
        # "CPU group"), where a follower waits as long as rank 0 has nothing to run, and a step
        # never touches a GPU.
        self.compute = dist.new_group(backend=self.backend, timeout=collective_timeout())
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def _store(self, is_master: bool) -> dist.TCPStore:
        """The rendezvous store of a launch of our own: rank 0 serves it on a port the system picks
        (no window for another process to take it) and puts that in MASTER_PORT for the ranks it
        starts; they connect to it."""
        port = 0 if is_master else int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port, self.size, is_master=is_master,
                              timeout=START_TIMEOUT, wait_for_workers=False)
        if is_master:
            os.environ["MASTER_PORT"] = str(store.port)
        return store

    def _wait_for_ranks(self, store: dist.TCPStore) -> None:
        """Rank 0: wait until every rank it started has checked in, watching that they live."""
        keys = [f"stagewise/up/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not store.check(keys):
            why = self.failure()
            if why is None and time.monotonic() > deadline:
                why = f"tensor parallel: the other ranks did not come up in {START_TIMEOUT}"
            if why is not None:
                self.abort(f"{why} before the group formed")  # start() closes
                raise RuntimeError(self.broken)
            time.sleep(0.05)

    # ---- the collectives the model calls (identity at size 1) -------------------------------

    def all_reduce(self, t: Tensor) -> Tensor:
        """Every rank's `t` summed, in place, on every rank."""
        if self.size > 1:
            self.counts["all_reduce"] += 1
            self.counts["all_reduce_bytes"] += t.numel() * t.element_size()
            with record_function("tensor_parallel::all_reduce"):  # a profile's span: the wait for the others included
                dist.all_reduce(t, group=self.compute)
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
            dist.gather(t, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1) if parts is not None else t

    def logits_width(self, vocab: int) -> int:
        """The logits this rank's forward returns: the whole vocabulary on rank 0, its slice elsewhere."""
        return vocab if self.rank == 0 else -(-vocab // self.size)

    # ---- rank 0 leads, the others follow ----------------------------------------------------

    def send(self, message: Any) -> None:
        """Rank 0: what every other rank must run now (a step's inputs, or STOP)."""
        if self.size == 1:
            return
        why = self.failure()
        if why is not None:  # a rank died since the last step: stop the others, they wait in vain
            self._give_up(why)
        self.counts["broadcast"] += 1
        self.counts["broadcast_bytes"] += len(pickle.dumps(message))  # what the broadcast pickles and sends
        try:
            with record_function("tensor_parallel::broadcast"):
                dist.broadcast_object_list([message], src=0, group=self.control)
        except (RuntimeError, OSError) as exc:
            # A rank has died since the check above: one this process started (failure() names
            # it), or one it cannot watch (torchrun's), whose socket gloo finds closed at once.
            first_line = str(exc).partition("\n")[0][:200]
            self._give_up(self.failure() or f"tensor parallel: the other ranks could not be reached, one has "
                                             f"likely died ({type(exc).__name__}: {first_line})", exc)

    def _give_up(self, why: str, cause: BaseException | None = None) -> NoReturn:
        """Stop the ranks with `why`, unless something stopped them already, and raise the reason
        they were stopped for: every later step fails with it too."""
        if not self.broken:
            self.abort(f"{why}; the others were stopped" if self.workers else why)
        raise RuntimeError(self.broken) from cause

    def failure(self) -> str | None:
        """Why this group can run no more steps (a step was aborted, or a rank this process started
        has died), or None. It only looks: `/health` asks it from another thread while steps run."""
        if self.broken:
            return self.broken
        for rank, p in enumerate(self.workers, start=1):
            if not p.is_alive():
                return f"tensor parallel: rank {rank} died (exit code {p.exitcode})"
        return None

    def lead(self, step: Step, run: Callable[[], Tensor]) -> Tensor:
        """Rank 0: send `step` to the other ranks, then `run` it here; its logits. If it fails
        here, the others may be inside its collectives, out of step for good: they are stopped."""
        if self.size == 1:
            return run()
        self.send(step.cpu())
        try:
            return run()
        except BaseException as exc:
            self.abort(f"tensor parallel: a step failed on rank 0 ({type(exc).__name__}: {exc}); "
                       "the other ranks were out of step and were stopped")
            raise

    def follow(self, run: Callable[[Step], Any]) -> NoReturn:
        """The other ranks: run every step rank 0 sends, until it sends STOP (or dies); then
        leave the group and end the process."""
        try:
            with torch.inference_mode():
                while True:
                    box = [None]
                    dist.broadcast_object_list(box, src=0, group=self.control)
                    if box[0] == STOP:
                        break
                    run(box[0])
        finally:
            self.close()
        raise SystemExit(0)

    def abort(self, reason: str) -> None:
        """Stop the ranks this process started, at once and without a collective: a step failed
        half-way (the ranks are no longer in step), or one is still running. Every later step fails
        with `reason`. (Under torchrun the others end when their next collective times out.)"""
        self.broken = reason
        for p in self.workers:
            p.kill()
            p.join(10)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for them, and end the process group."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if self._group and dist.is_initialized():
            if self.rank == 0 and not self.broken:
                try:
                    self.send(STOP)
                except (RuntimeError, OSError):
                    pass  # a rank died: there is nobody left to stop
            dist.destroy_process_group()
        self._group = False
        self.compute = self.control = None  # they hold the rendezvous store (rank 0: its port) while referenced
        for p in self.workers:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.workers = []
        if self._threads:
            set_intra_op_threads(self._threads)  # the process's threads as they were
            self._threads = None


# ----------------------------------------------------------------------------- the other ranks

def rank_device(device: str) -> str:
    """This rank's device: under torchrun (or a launch of our own) a GPU rank takes its local
    rank's GPU; a CPU is shared."""
    from common.loader import resolve_device

    if resolve_device(device).type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


def _worker_main(env: dict[str, str], job: dict) -> None:
    """A rank that rank 0 started: the environment torchrun would give it, then the same engine,
    which follows rank 0's steps inside its constructor and ends the process (SystemExit(0))
    when rank 0 closes."""
    os.environ.update(env, STAGEWISE_TP_WORKER="1", LOCAL_RANK=env["RANK"])
    import importlib

    from common.loader import load_model

    if job.get("threads"):
        set_intra_op_threads(job["threads"])
    loaded = load_model(job["model"], device=rank_device(job["device"]), dtype=job["dtype"], weights=False)
    engine_cls = importlib.import_module(job["package"]).InferenceEngine
    engine_cls(loaded, **job["kwargs"])
