"""Stage 12's own idea: decode-only steps run through padded buckets, as CUDA graphs replay them.

Cross-stage parity is in tests/test_parity.py, the GPU itself in tests/test_cuda.py. Here, on any
device (on a CPU, asked with enforce_eager=False, the same buckets, buffers and padding run, the
graph's function called eagerly; by default a CPU engine runs eagerly, as vLLM's CPU backend does):
greedy tokens equal transformers' and the eager path's for batches that fill a bucket and that
don't, for sequences that cross a block and a table-width bucket mid-run, for requests joining
and leaving between steps, and after a cancel; padded rows never write into a live block; the
captured function makes no host sync, no data-dependent shape and no tensor from Python values,
and runs the same ops for every batch of one bucket; steps with prompt chunks, and batches above
the largest bucket, run eagerly; bad knobs are refused by name.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.requests import Request, SamplingParams
from stages import s12_cuda_graphs as s12
from stages.s12_cuda_graphs.cuda_graphs import batch_buckets, bucket, width_buckets

BS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _all_free(engine) -> None:
    alloc = engine.pool.allocator
    assert alloc.reserved == 0
    assert alloc.num_free == alloc.num_blocks and not any(alloc.ref_counts)


def _spy_runs(engine) -> list[tuple[int, int | None]]:
    """Record every decode step the engine asked the graphs about: (real batch, the bucket it ran
    in, or None when it had none and ran eagerly)."""
    runs: list[tuple[int, int | None]] = []
    fits, run = engine.graphs.fits, engine.graphs.run

    def spy_fits(batch: int) -> bool:
        if not fits(batch):
            runs.append((batch, None))
        return fits(batch)

    def spy_run(ids, rows, new_pos, new_slots, num_blocks):
        runs.append((len(ids), bucket(len(ids), engine.graphs.batch_sizes)))
        return run(ids, rows, new_pos, new_slots, num_blocks)

    engine.graphs.fits, engine.graphs.run = spy_fits, spy_run
    return runs


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20] and batch_buckets(3) == [1, 2, 3]
    assert width_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128] and width_buckets(12) == [1, 2, 4, 8, 12]
    assert [bucket(n, [1, 2, 4, 8]) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


@pytest.mark.parametrize("n", [8, 5, 3])  # fills the bucket of 8; pads 5 to 8; pads 3 to 4
def test_tokens_equal_transformers_and_the_eager_path(n: int, tiny, hf_greedy) -> None:
    prompts = [_ids(2 + 3 * i, seed=10 * n + i) for i in range(n)]
    params = SamplingParams(max_new_tokens=9, stop_on_eos=False)
    graphs = s12.InferenceEngine(tiny, max_batch_size=8, block_size=BS, enforce_eager=False)
    eager = s12.InferenceEngine(tiny, max_batch_size=8, block_size=BS, enforce_eager=True)
    runs = _spy_runs(graphs)
    got = [c.token_ids for c in graphs.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    assert got == [c.token_ids for c in eager.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    assert got == [hf_greedy(p, 9) for p in prompts]
    assert eager.graphs is None and runs and all(b is not None for _, b in runs)  # every decode step took a bucket
    assert (n, bucket(n, [1, 2, 4, 8])) in runs
    _all_free(graphs)


def test_sequences_cross_a_block_and_a_width_bucket_mid_run(tiny, hf_greedy) -> None:
    """A 3-token prompt that generates 30 tokens fills 1, 2, ... 9 blocks of 4: the table's width
    crosses the buckets 1, 2, 4, 8 and 16 while the batch decodes."""
    prompts = [_ids(3, seed=1), _ids(6, seed=2)]
    engine = s12.InferenceEngine(tiny, max_batch_size=2, block_size=BS, enforce_eager=False)
    widths: list[int] = []
    run = engine.graphs.run
    engine.graphs.run = lambda ids, rows, p, s, nb: (widths.append(bucket(nb, engine.graphs.widths)), run(ids, rows, p, s, nb))[1]
    params = SamplingParams(max_new_tokens=30, stop_on_eos=False)
    got = [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
    assert got == [hf_greedy(p, 30) for p in prompts]
    assert sorted(set(widths)) == [2, 4, 8, 16]
    _all_free(engine)


def test_padded_rows_never_touch_a_live_block(tiny) -> None:
    """A step of 5 in the bucket of 8 after a step of 8: the 3 padded rows carry stale rows of the
    bigger step unless they are reset; only the 5 new slots and the pad block may change."""
    engine = s12.InferenceEngine(tiny, max_batch_size=8, block_size=BS, enforce_eager=False)
    sched = s12.OnlineScheduler(engine, max_batch_size=8)
    params = [SamplingParams(max_new_tokens=3 if i < 3 else 12, stop_on_eos=False) for i in range(8)]
    ids = [sched.add_request(prompt_token_ids=_ids(5 + i, seed=40 + i), params=p) for i, p in enumerate(params)]
    while any(sched.session(r).prefilling for r in ids):
        sched.step()
    while sum(not sched.session(r).finished for r in ids) == 8:
        sched.step()  # steps of 8, until the three short ones finish
    live = [sched.session(r) for r in ids if not sched.session(r).finished]
    assert len(live) == 5
    before = [t.clone() for t in engine.pool.k + engine.pool.v]
    runs = _spy_runs(engine)
    sched.step()
    assert runs == [(5, 8)]
    pad = engine.pool.pad_block
    for old, new in zip(before, engine.pool.k + engine.pool.v):
        differ = (old != new) & ~(old.isnan() & new.isnan())  # blocks never taken hold whatever memory had
        changed = differ.any(dim=(0, 3)).nonzero().tolist()  # [block, offset] pairs that changed
        slots = {b * BS + o for b, o in changed if b != pad}
        written = {s.block_table[(s.num_cached - 1) // BS] * BS + (s.num_cached - 1) % BS for s in live}
        assert slots <= written, f"a padded row wrote into {sorted(slots - written)}"
        assert len(slots) == 5  # the five real rows did write (a test that sees no write proves nothing)


class _CaptureRules(TorchDispatchMode):
    """What a CUDA graph capture refuses, caught on any device: an op that waits for the device
    (`.item()`, `.tolist()`), one whose output shape depends on data, or a tensor made from Python
    values (it would be a constant baked into the graph). Records every op, in order."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh", "_assert_async")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(bad in name for bad in self.FORBIDDEN):
            raise AssertionError(f"{name} inside the captured function")
        if "index" in name and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                   for a in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [])):
            raise AssertionError(f"{name} with a boolean mask inside the captured function")
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_the_captured_function_is_capturable_and_the_same_for_every_batch_of_a_bucket(tiny) -> None:
    engine = s12.InferenceEngine(tiny, max_batch_size=8, block_size=BS, enforce_eager=False)
    sched = s12.OnlineScheduler(engine, max_batch_size=8)
    ops_of: dict[int, list[str]] = {}
    forward = engine.graphs.forward

    def checked(G: int, W: int) -> torch.Tensor:
        with _CaptureRules() as rules:
            out = forward(G, W)
        ops_of[sched.num_unfinished] = rules.ops  # the run's last step: its first may still grow a buffer
        return out

    engine.graphs.close()  # on a GPU a step replays its graph and never calls forward: drop them, as on a CPU
    with torch.inference_mode():  # as a capture's warm-up does: the reused gather buffer at its largest,
        forward(8, engine.graphs.widths[-1])  # made as an inference tensor
    forward(8, engine.graphs.widths[-1])  # a caller outside inference mode (a test) writes it in place too
    engine.graphs.forward = checked
    for n in (5, 7):  # both pad to the bucket of 8
        rids = [sched.add_request(prompt_token_ids=_ids(6, seed=60 + i), params=SamplingParams(max_new_tokens=4, stop_on_eos=False))
                for i in range(n)]
        while sched.has_unfinished():
            sched.step()
        for r in rids:
            sched.pop_completion(r)
    assert set(ops_of) == {5, 7} and ops_of[5] == ops_of[7] and len(ops_of[5]) > 50
    with pytest.raises(AssertionError, match="_local_scalar_dense"):  # the rules do catch a sync
        with _CaptureRules():
            torch.ones(2).sum().item()


def test_steps_with_chunks_and_batches_above_the_largest_bucket_run_eagerly(tiny, hf_greedy) -> None:
    engine = s12.InferenceEngine(tiny, max_batch_size=6, block_size=BS, max_cudagraph_capture_size=4,
                                 max_num_batched_tokens=12, enforce_eager=False)
    assert engine.graphs.batch_sizes == [1, 2, 4]
    runs = _spy_runs(engine)
    calls: list[bool] = []  # per step forward: did it have prompt chunks?
    step_forward = engine._step_forward
    engine._step_forward = lambda d, c, s: (calls.append(bool(c)), step_forward(d, c, s))[1]
    prompts = [_ids(2, seed=70 + i) for i in range(6)]  # all six prefilled in the first step
    params = [SamplingParams(max_new_tokens=3 if i % 2 else 7, stop_on_eos=False) for i in range(6)]
    got = [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params)])]
    assert got == [hf_greedy(p, q.max_new_tokens) for p, q in zip(prompts, params)]
    assert calls[0] and len(runs) == calls.count(False)  # a step with chunks never asks the graphs
    assert {n for n, b in runs if b is None} == {6} and {n for n, b in runs if b is not None} == {3}
    stats = engine.kv_stats()  # the steps each way, as the bench reports them
    assert stats["graph_steps"] == sum(b is not None for _, b in runs)
    assert stats["eager_steps"] == len(calls) - stats["graph_steps"] > 0


def test_joining_leaving_and_cancelling_between_replays(tiny, hf_greedy) -> None:
    rng = random.Random(7)
    engine = s12.InferenceEngine(tiny, max_batch_size=4, block_size=BS, num_kv_blocks=64, enforce_eager=False)
    with s12.SchedulerManager(engine, max_batch_size=4) as mgr:
        handles = []
        for i in range(14):
            prompt, n = _ids(rng.randint(1, 20), seed=80 + i), rng.randint(1, 12)
            handles.append((prompt, n, mgr.add_request(prompt_token_ids=prompt, max_new_tokens=n, stop_on_eos=False)))
            if i % 5 == 4:
                handles[-2][2].cancel()
        for prompt, n, h in handles:
            done = h.result(timeout=60)
            if done.finish_reason != "cancelled":
                assert done.token_ids == hf_greedy(prompt, n)
            else:
                assert done.token_ids == hf_greedy(prompt, n)[: len(done.token_ids)]
    _all_free(engine)


def test_a_cpu_engine_runs_eagerly_unless_asked_for_the_padded_path(tiny, hf_greedy) -> None:
    """The graphs save launches, which only a GPU has: by default a CPU engine runs eagerly (no
    buckets, no padding) and a CUDA one through the graphs; enforce_eager=False gives the padded
    path on either."""
    on_gpu = tiny.device.type == "cuda"
    default = s12.InferenceEngine(tiny, max_batch_size=4, block_size=BS)
    padded = s12.InferenceEngine(tiny, max_batch_size=4, block_size=BS, enforce_eager=False)
    assert (default.graphs is not None) == on_gpu and isinstance(padded.graphs, s12.DecodeGraphs)
    prompts = [_ids(3 + 2 * i, seed=90 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    for engine in (default, padded):
        got = [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]
        assert got == [hf_greedy(p, 6) for p in prompts]
    assert (default.kv_stats()["graph_steps"] > 0) == on_gpu and default.kv_stats()["eager_steps"] > 0
    assert padded.kv_stats()["graph_steps"] > 0


def test_bad_knobs_are_refused_by_name_and_close_frees_the_graphs(tiny) -> None:
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
            s12.InferenceEngine(tiny, max_batch_size=8, max_cudagraph_capture_size=bad)
    engine = s12.InferenceEngine(tiny, max_batch_size=2, block_size=BS, enforce_eager=False)
    assert engine.kv_stats()["cudagraphs"] == len(engine.graphs.graphs)
    engine.close()
    assert engine.graphs is None and engine.kv_stats()["cudagraphs"] == 0
    params = SamplingParams(max_new_tokens=3, stop_on_eos=False)
    assert len(engine.generate([Request(prompt_token_ids=_ids(4, seed=1), params=params)])[0].token_ids) == 3


def test_the_capture_size_is_at_most_512_by_default_and_its_buffers_must_fit(tiny, monkeypatch) -> None:
    """vLLM's default cap; past it the step runs eagerly. An explicit size whose logits buffer
    ([size, V]) cannot fit was a RuntimeError from the allocator; it is a ValueError naming the knob."""
    import common.memory

    engine = s12.InferenceEngine(tiny, max_batch_size=600, max_num_batched_tokens=600, num_kv_blocks=64,
                                 enforce_eager=False)
    assert engine.graphs.batch_sizes[-1] == 512
    engine.close()
    monkeypatch.setattr(common.memory, "device_memory_bytes", lambda device: 10**6)  # the pool fits, the buffer not
    with pytest.raises(ValueError, match=r"^the CUDA graphs' logits buffer \(64 rows\) needs .* lower max_cudagraph_capture_size$"):
        s12.InferenceEngine(tiny, max_batch_size=64, num_kv_blocks=4, block_size=4, enforce_eager=False)
