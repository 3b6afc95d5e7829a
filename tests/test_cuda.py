"""What only a GPU can show: syncs inside a decode step, a tensor left on the CPU, memory given back.

Skipped where there is no CUDA device (CI). Run them on a GPU with the rest of the suite:
`STAGEWISE_TEST_DEVICE=cuda python -m pytest -q` (README, "On a GPU"). Most tensors left
on the wrong device make the first op that mixes them with a GPU tensor raise, and every stage's
tests run on the GPU under that switch; an index tensor does not (PyTorch copies it over at every
use), so every tensor an engine keeps is checked for its device too.

Syncs: CUDA runs kernels asynchronously, so a step is fast when the host only queues work and
waits once, to read the sampled tokens it must decide with (finish, stream, next input). Any other
wait (`.item()`, `.tolist()`, a copy from pageable host memory) stalls the queue every step.
`torch.cuda.set_sync_debug_mode("warn")` makes each synchronizing call warn, so a count of
warnings over a run is a count of syncs. Prefill and start-up syncs are not the decode step's: the
test runs the same prompts for two lengths, each in a fresh engine (a warm prefix cache would make
the runs prefill differently: from stage 08 on, cache hits by token ids), and counts only the
difference, per extra forward.
"""

from __future__ import annotations

import gc
import random
import warnings

import pytest
import torch

from common.bench import profile_decode, profile_prefill, profiling  # at the top: a CPU run collects this file, so a wrong path fails there too
from common.requests import Request, SamplingParams
from conftest import STAGE_DIRS, stage_module, streaming_packages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DECODE_STAGES = [s for s in STAGE_DIRS if s != "s01_naive_batching"]  # stage 01 has no decode step
SHORT, LONG = 8, 40  # new tokens: the difference is 32 decode steps (two 16-token blocks filled)


@pytest.fixture(scope="module")
def tiny_cuda():
    from common.loader import load_model

    return load_model("tiny", device="cuda", dtype="float32")


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(n)]


class ForwardCounter:
    """Stands in for engine.model: counts its forwards (prefill and decode alike)."""

    def __init__(self, model) -> None:
        self.model, self.forwards = model, 0

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def _syncs(run) -> int:
    """How many synchronizing CUDA calls `run()` made."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("stage", DECODE_STAGES)
def test_a_decode_step_syncs_only_to_read_the_sampled_tokens(stage, tiny_cuda):
    prompts = _prompts()

    def run(new_tokens: int) -> tuple:
        """A fresh engine (an empty prefix cache: both runs prefill alike) and its generate for these prompts."""
        engine = stage_module(stage).InferenceEngine(tiny_cuda, max_batch_size=4)
        engine.model = counter = ForwardCounter(engine.model)
        graphs = getattr(engine, "graphs", None)  # stage 12+: a replayed step calls no forward, count it here
        if graphs is not None:
            run = graphs.run
            graphs.run = lambda *a: (setattr(counter, "forwards", counter.forwards + 1), run(*a))[1]
        params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
        return counter, lambda: engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])

    run(LONG)[1]()  # warm-up: first-use allocations and caches are not a step's cost
    (short_counter, short_run), (long_counter, long_run) = run(SHORT), run(LONG)
    short, long = _syncs(short_run), _syncs(long_run)
    short_forwards, long_forwards = short_counter.forwards, long_counter.forwards
    per_step = (long - short) / (long_forwards - short_forwards)
    assert per_step <= 1.0, (f"{stage}: {per_step:.2f} syncs per decode step ({short} syncs in {short_forwards} "
                             f"forwards for {SHORT} tokens, {long} in {long_forwards} for {LONG})")


def _tensors(obj, path: str, seen: set[int], depth: int = 4):
    """(path, tensor) for every tensor reachable from `obj` through attributes, lists and dicts."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, torch.nn.Module):
        return  # the model: placed by load_model, checked by every parity test on the GPU
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}[{key!r}]", seen, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{i}]", seen, depth - 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("stages.", "common.")):
        for key, value in vars(obj).items():
            yield from _tensors(value, f"{path}.{key}", seen, depth - 1)


@pytest.mark.parametrize("stage", DECODE_STAGES)
def test_every_tensor_an_engine_keeps_is_on_the_gpu(stage, tiny_cuda):
    """A CPU tensor indexing a GPU one does not fail: it is copied over at every use, silently."""
    engine = stage_module(stage).InferenceEngine(tiny_cuda, max_batch_size=4)
    params = SamplingParams(max_new_tokens=20, stop_on_eos=False)
    engine.generate([Request(prompt_token_ids=p, params=params) for p in _prompts()])
    found = list(_tensors(engine, "engine", set()))
    on_cpu = [f"{path} {tuple(t.shape)}" for path, t in found if t.device.type != "cuda"]
    assert not on_cpu, f"{stage}: {on_cpu}"


@pytest.mark.parametrize("package", streaming_packages())
def test_close_gives_the_kv_memory_back(package, tiny_cuda):
    from common import stages as registry

    stage = registry.load_stage(package)
    # Twice, measuring the second: the first worker thread's first matmul makes cuBLAS's workspace
    # for its handle (32 MiB on an H200), which torch keeps for the handle's next thread: not the engine's.
    for measured in (False, True):
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # the model's weights are loaded already
        manager = stage.SchedulerManager(stage.InferenceEngine(tiny_cuda, max_batch_size=4), max_batch_size=4)
        handles = [manager.add_request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=16, stop_on_eos=False))
                   for p in _prompts(6, seed=1)]
        assert all(len(h.result(timeout=120).token_ids) == 16 for h in handles)
        assert torch.cuda.memory_allocated() > before  # the engine's KV pool lives on the GPU
        manager.close()
        del manager, handles
        gc.collect()
        torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    assert measured and kept == 0, f"{package}: {kept} bytes kept"


@pytest.mark.parametrize("program, stage", [("profile_decode", "9"), ("profile_decode", "12"), ("profile_prefill", "9")])
def test_profiles_count_the_gpu_kernels(program, stage, tmp_path):
    """On CUDA an op's CPU time is its launch: both profilers also record their kernels' time.
    Stage 12's decode steps replay graphs, whose kernels no op launched: they get a row of their own."""
    import json

    module = {"profile_decode": profile_decode, "profile_prefill": profile_prefill}[program]
    shape = (["--batch", "2", "--prompt-len", "9", "--steps", "3"] if program == "profile_decode"
             else ["--prompt-len", "24", "--repeats", "1"])
    out = tmp_path / "profile.json"
    assert module.main(["--stage", stage, "--model", "tiny", "--device", "cuda", "--dtype", "float32", *shape,
                        "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"].startswith("cuda") and r["kernel_ms_per_step"] > 0
    assert sum(r["groups_kernel_ms"].values()) == pytest.approx(r["kernel_ms_per_step"])
    assert all("kernel_ms_per_step" in row for row in r["ops"])
    graph = [row for row in r["ops"] if row["op"] == profiling.GRAPH_KERNELS]
    if stage == "12":  # nearly all of a replayed step's kernels
        assert graph and graph[0]["kernel_ms_per_step"] > 0.5 * r["kernel_ms_per_step"]
    else:
        assert not graph


def test_stage12_captures_replays_as_eager_and_close_gives_the_graphs_back(tiny_cuda):
    """The graphs exist after start; a replay gives the bits the same function gives eagerly on
    the same buffers (fp32); the tokens equal the eager engine's; close() returns the graphs' memory."""
    from stages.s12_cuda_graphs.cuda_graphs import bucket

    s12 = stage_module("s12_cuda_graphs")
    s12.InferenceEngine(tiny_cuda, max_batch_size=8).close()  # once first: what a process keeps after its first capture is not ours
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = s12.InferenceEngine(tiny_cuda, max_batch_size=8)
    graphs = engine.graphs
    assert len(graphs.graphs) == len(graphs.batch_sizes) * len(graphs.widths) and graphs.capture_s > 0
    assert graphs.pool_bytes > 0  # the H200 once reported a negative pool: cache freed inside the capture
    assert engine.kv_stats()["cudagraphs"] == len(graphs.graphs)

    sched = s12.OnlineScheduler(engine, max_batch_size=8)
    params = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    prompts = _prompts(5, seed=3)
    rids = [sched.add_request(prompt_token_ids=p, params=params) for p in prompts]
    while any(sched.session(r).prefilling for r in rids):
        sched.step()
    seen = []
    run = graphs.run

    def spy(ids, rows, new_pos, new_slots, num_blocks):
        out = run(ids, rows, new_pos, new_slots, num_blocks)
        seen.append((bucket(len(ids), graphs.batch_sizes), bucket(num_blocks, graphs.widths), out.clone()))
        return out

    graphs.run = spy
    sched.step()
    (G, W, replayed), = seen
    assert G == 8 and torch.equal(replayed, graphs.forward(G, W)[:5])  # the same function, eagerly: the same bits
    while sched.has_unfinished():
        sched.step()
    got = [sched.pop_completion(r).token_ids for r in rids]
    eager = s12.InferenceEngine(tiny_cuda, max_batch_size=8, enforce_eager=True)
    assert got == [c.token_ids for c in eager.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    del eager
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with_graphs = torch.cuda.memory_reserved()
    engine.close()
    del graphs, seen, replayed, run, spy  # what this test itself kept of them
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < with_graphs  # the graphs' pool went back to the device
    del engine, sched
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == 0


def test_s11_bf16_steps_never_run_cudnn_attention():
    """SDPA's cuDNN backend made an H200's eager steps several times slower (stage 13's took
    225 ms with it, 38 without): our eager forwards leave it out (`DecoderModel.cudnn_attention`). A bf16
    run of prefill chunks and decode steps on the post's model shape, where it was SDPA's pick,
    shows SDPA's other kernels and none of cuDNN's."""
    from torch.profiler import ProfilerActivity, profile

    from common.loader import load_model

    loaded = load_model("gpt2-random", device="cuda", dtype="bfloat16")
    engine = stage_module("s11_chunked_prefill").InferenceEngine(loaded, max_batch_size=4)
    requests = [Request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=6, stop_on_eos=False))
                for p in _prompts(3, seed=7)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
    names = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in n for n in names)  # attention ran, and the profiler saw it
    assert not [n for n in names if "cudnn" in n.lower() and ("attention" in n.lower() or "sdpa" in n.lower())]
