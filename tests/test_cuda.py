"""What only a GPU can show: host-device syncs inside a decode step, and memory given back.

Skipped where there is no CUDA device (CI). Run them on a GPU with the rest of the suite:
`STAGEWISE_TEST_DEVICE=cuda python -m pytest -q` (the README's CUDA section). A tensor left on
the wrong device needs no test of its own: the first op that mixes it with a GPU tensor raises,
and every stage's tests run on the GPU under that switch.

Syncs: CUDA runs kernels asynchronously, so a step is fast when the host only queues work and
waits once, to read the sampled tokens it must decide with (finish, stream, next input). Any other
wait (`.item()`, `.tolist()`, a copy from pageable host memory) stalls the queue every step.
`torch.cuda.set_sync_debug_mode("warn")` makes each synchronizing call warn, so a count of
warnings over a run is a count of syncs. Prefill and start-up syncs are not the decode step's: the
test runs the same prompts for two lengths and counts only the difference, per extra step.
"""

from __future__ import annotations

import gc
import random
import warnings

import pytest
import torch

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
    engine = stage_module(stage).InferenceEngine(tiny_cuda, max_batch_size=4)
    prompts = _prompts()

    def run(new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
        return lambda: engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])

    run(LONG)()  # warm-up: first-use allocations and caches are not a step's cost
    short, long = _syncs(run(SHORT)), _syncs(run(LONG))
    per_step = (long - short) / (LONG - SHORT)
    assert per_step <= 1.0, f"{stage}: {per_step:.2f} syncs per decode step ({short} for {SHORT} tokens, {long} for {LONG})"


@pytest.mark.parametrize("package", streaming_packages())
def test_close_gives_the_kv_memory_back(package, tiny_cuda):
    from common import stages as registry

    stage = registry.load_stage(package)
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
    assert torch.cuda.memory_allocated() == before, f"{package}: {torch.cuda.memory_allocated() - before} bytes kept"
