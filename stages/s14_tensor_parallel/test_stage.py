"""Stage 14's own idea: one model split across ranks (gloo on a CPU), the scheduler on rank 0.

Cross-stage parity (at size 1, stage 13 exactly) is in tests/test_parity.py. Here, at sizes 2
and 3: greedy tokens equal transformers' (fp32); each rank holds 1/N of every layer and of the
vocabulary; streaming and the prefix cache, chunked prefill and preemption work as before; a
size that does not divide the heads is refused by name; a rank that dies ends the run with an
error at once, never a hang; and two torchrun "nodes" on 127.0.0.1 give the same tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.requests import Request, SamplingParams
from stages import s14_tensor_parallel as s14
from stages.s14_tensor_parallel.parallel import TensorParallel
from stages.s14_tensor_parallel.sharding import ShardReader

BS = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tp_tiny(tiny):
    """`tiny` where two ranks can run it: on the test device if it has a GPU per rank (NCCL),
    else on the CPU (gloo). A one-GPU machine runs these on its CPU; the size check refuses two."""
    if tiny.device.type == "cpu" or torch.cuda.device_count() >= 2:
        return tiny
    from common.loader import load_model

    return load_model("tiny", device="cpu", dtype="float32")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _generate(engine, prompts, n):
    params = SamplingParams(max_new_tokens=n, stop_on_eos=False)
    return [c.token_ids for c in engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])]


def test_two_ranks_give_transformers_tokens_and_hold_half_of_every_layer(tp_tiny, hf_greedy) -> None:
    prompts = [_ids(3 + 7 * i, seed=i) for i in range(5)]
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=4, block_size=BS, tensor_parallel_size=2,
                                 enforce_eager=False)  # the graphs' padded path, a GPU's, on every rank
    try:
        assert _generate(engine, prompts, 10) == [hf_greedy(p, 10) for p in prompts]
        full, mine = tp_tiny.model, engine.model
        for a, b in zip(full.layers, mine.layers):  # every projection: half its rows or half its columns
            for name in ("qkv", "o", "gate_up", "down"):
                assert getattr(b, f"{name}_weight").numel() * 2 == getattr(a, f"{name}_weight").numel(), name
        assert mine.embed_tokens.weight.shape[0] * 2 == full.embed_tokens.weight.shape[0]
        assert engine.pool.k[0].shape[0] * 2 == tp_tiny.config.num_kv_heads  # the K/V of its own heads only
        nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
        norms = nbytes(p for n, p in full.named_parameters() if "norm" in n)  # every rank holds them whole
        assert nbytes(mine.parameters()) == (nbytes(full.parameters()) - norms) // 2 + norms
        assert engine.tp.bytes_loaded == nbytes(mine.parameters())  # read from the checkpoint: its share alone
    finally:
        engine.close()


def test_streaming_chunked_prefill_prefix_cache_and_preemption_under_two_ranks(tp_tiny, hf_greedy) -> None:
    system = _ids(3 * BS, seed=20)
    prompts = [system + _ids(2 + i, seed=30 + i) for i in range(6)]
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=4, block_size=BS, num_kv_blocks=24, max_num_batched_tokens=8,
                                 tensor_parallel_size=2)
    try:
        with s14.SchedulerManager(engine, max_batch_size=4) as mgr:
            handles = [mgr.add_request(prompt_token_ids=p, max_new_tokens=20, stop_on_eos=False) for p in prompts]
            streamed = [[t for chunk in h for t in chunk.token_ids] for h in handles]
        assert streamed == [hf_greedy(p, 20) for p in prompts]
        stats = engine.kv_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    finally:
        engine.close()


def test_on_a_cpu_the_ranks_pools_together_must_fit_the_host(tiny, monkeypatch) -> None:
    """Each rank holds 1/N of the pool, but on a CPU all N live in one host's memory: a pool whose
    share fits while the whole does not is refused by name before any rank starts."""
    import common.memory
    from common.memory import kv_bytes

    if tiny.device.type != "cpu":
        pytest.skip("on a GPU each rank's share has a GPU of its own")
    whole = kv_bytes(tiny.config, (1000 + 1) * BS, tiny.dtype.itemsize)
    monkeypatch.setattr(common.memory, "device_memory_bytes", lambda device: whole - 1)  # each half fits
    with pytest.raises(ValueError, match=r"^the KV pool \(num_kv_blocks=1000, block_size=4\)"):
        s14.InferenceEngine(tiny, max_batch_size=2, block_size=BS, num_kv_blocks=1000, tensor_parallel_size=2)


def test_sizes_that_cannot_split_the_model_are_refused_by_name(tiny) -> None:
    for size in (0, 3):  # tiny has 4 heads and 2 KV heads
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            s14.InferenceEngine(tiny, max_batch_size=2, tensor_parallel_size=size)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="more ranks than GPUs"):
            TensorParallel(2, tiny.config, torch.device("cuda"))


def test_each_rank_reads_its_slice_and_the_vocabulary_is_padded(tiny, tmp_path) -> None:
    """A checkpoint whose vocabulary (7) three ranks do not divide: rows 3 + 3 + 1, the last
    rank's padded with zeros; the q rows of one's heads; an o_proj bias on rank 0 alone."""
    from safetensors.torch import save_file

    embed = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    q = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)  # 3 heads of 2 dims
    bias = torch.ones(4)
    save_file({"model.embed_tokens.weight": embed, "model.layers.0.self_attn.q_proj.weight": q,
               "model.layers.0.self_attn.o_proj.bias": bias}, tmp_path / "model.safetensors")
    import dataclasses
    config = dataclasses.replace(tiny.config, vocab_size=7, num_heads=3, head_dim=2)
    readers = [ShardReader(tmp_path, config, rank, 3) for rank in range(3)]
    embeds = [r["model.embed_tokens.weight"] for r in readers]
    assert [e.shape[0] for e in embeds] == [3, 3, 3] and torch.equal(torch.cat(embeds)[:7], embed)
    assert torch.equal(embeds[2][1:], torch.zeros(2, 2))
    assert torch.equal(readers[1]["model.layers.0.self_attn.q_proj.weight"], q[2:4])
    assert [r["model.layers.0.self_attn.o_proj.bias"].sum().item() for r in readers] == [4.0, 0.0, 0.0]
    assert readers[1].bytes_read == (3 * 2 + 2 * 4) * 4 and readers[0].bytes_read == (3 * 2 + 4) * 4  # rank 0 read no q


def test_a_rank_that_dies_ends_the_run_with_an_error_not_a_hang(tp_tiny) -> None:
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=2, block_size=BS, tensor_parallel_size=2)
    try:
        with s14.SchedulerManager(engine, max_batch_size=2) as mgr:
            first = mgr.add_request(prompt_token_ids=_ids(4, seed=1), max_new_tokens=3, stop_on_eos=False)
            assert len(first.result(timeout=60).token_ids) == 3
            worker = engine.tp.workers[0]
            worker.kill()
            worker.join(10)
            doomed = mgr.add_request(prompt_token_ids=_ids(4, seed=2), max_new_tokens=3, stop_on_eos=False)
            with pytest.raises(RuntimeError, match="rank 1 died"):
                doomed.result(timeout=60)
    finally:
        engine.close()


def test_a_rank_it_did_not_start_dies_and_the_next_step_fails_at_once(tp_tiny, monkeypatch) -> None:
    """Under torchrun rank 0 has no handle on the other ranks' processes: it learns of a death from
    the step's broadcast, whose socket gloo finds closed. The collectives' timeout is set far past
    the wait below: a step that waited for it would fail the test."""
    monkeypatch.setenv("STAGEWISE_TP_TIMEOUT_S", "600")
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=2, block_size=BS, tensor_parallel_size=2)
    worker = engine.tp.workers.pop()  # as under torchrun: not this process's to watch
    try:
        with s14.SchedulerManager(engine, max_batch_size=2) as mgr:
            first = mgr.add_request(prompt_token_ids=_ids(4, seed=1), max_new_tokens=3, stop_on_eos=False)
            assert len(first.result(timeout=60).token_ids) == 3
            worker.kill()
            worker.join(10)
            for seed in (2, 3):  # the next step, and every one after it
                doomed = mgr.add_request(prompt_token_ids=_ids(4, seed=seed), max_new_tokens=3, stop_on_eos=False)
                with pytest.raises(RuntimeError, match="could not be reached, one has likely died"):
                    doomed.result(timeout=60)
    finally:
        engine.close()
        worker.join(10)


def test_gpt2_random_at_two_and_three_ranks_gives_transformers_tokens() -> None:
    """GPT-2's layout: c_attn's q, k and v side by side, stored [in, out]; a bias in every
    projection, the row-parallel ones on rank 0 alone. 12 heads: two ranks and three."""
    from transformers import AutoModelForCausalLM

    from common.loader import load_model
    from conftest import run_hf_greedy

    gpt2 = load_model("gpt2-random", device="cpu", dtype="float32")
    prompts = [_ids(5 + 4 * i, seed=40 + i) for i in range(3)]
    hf = AutoModelForCausalLM.from_pretrained(gpt2.path, dtype=torch.float32).eval()
    expected = [run_hf_greedy(hf, p, 6, gpt2.config.eos_token_ids) for p in prompts]
    for size in (2, 3):
        engine = s14.InferenceEngine(gpt2, max_batch_size=4, block_size=BS, tensor_parallel_size=size)
        try:
            params = SamplingParams(max_new_tokens=6)
            got = engine.generate([Request(prompt_token_ids=p, params=params) for p in prompts])
            assert [c.token_ids for c in got] == expected, size
        finally:
            engine.close()


def test_two_torchrun_nodes_on_localhost(tiny, hf_greedy) -> None:
    """Two "machines" of one rank each, as `torchrun --nnodes 2` starts them with a rendezvous:
    every rank runs the same command, and the one that becomes rank 0 prints the text."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    prompt = "1, 2, 3, 4,"
    cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stagewise-test", "-m", "stages.s14_tensor_parallel",
           prompt, "--model", "tiny", "--device", "cpu", "--max-new-tokens", "6", "--no-chat",
           "--tensor-parallel-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    printed = [out for out, _ in outs if "###" in out]
    assert len(printed) == 1  # rank 0's node prints, the other follows
    from common.requests import prepare_prompt
    ids = prepare_prompt(Request(prompt=prompt), tiny.tokenizer, tiny.config.max_position_embeddings).token_ids
    expected = tiny.tokenizer.decode(hf_greedy(ids, 6), skip_special_tokens=True)
    assert expected.strip() in printed[0]


def test_an_idle_engine_outlives_the_collectives_timeout(tp_tiny, monkeypatch) -> None:
    """The other ranks wait for rank 0's next step as long as it has none: a served engine may
    idle for hours. (A collective of the model still times out: here after 2 s.)"""
    import time

    monkeypatch.setenv("STAGEWISE_TP_TIMEOUT_S", "2")
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=2, block_size=BS, tensor_parallel_size=2)
    try:
        first = _generate(engine, [_ids(5, seed=3)], 4)
        time.sleep(4)
        assert _generate(engine, [_ids(5, seed=3)], 4) == first
    finally:
        engine.close()


@pytest.mark.parametrize("wait_s,kept", [(0.2, True), (30.0, False)], ids=["step-outlasts-the-wait", "step-ends-in-time"])
def test_close_frees_the_decode_graphs_only_between_steps(tiny, monkeypatch, wait_s, kept) -> None:
    """A CUDA graph freed under its replay breaks the step replaying it. close() waits for a
    running step before it drops the graphs; a step that outlasts CLOSE_WAIT_S keeps them. Either
    way the step ends with the tokens of an eager run. (On a CPU, enforce_eager=False builds the
    graphs' object and runs their padded path: every line but the capture and replay.)"""
    import threading

    import stages.s14_tensor_parallel.engine as s14_engine

    prompt = [_ids(5, seed=6)]
    eager = s14.InferenceEngine(tiny, max_batch_size=2, block_size=BS, enforce_eager=True)
    try:
        want = _generate(eager, prompt, 3)
    finally:
        eager.close()
    monkeypatch.setattr(s14_engine, "CLOSE_WAIT_S", wait_s)
    engine = s14.InferenceEngine(tiny, max_batch_size=2, block_size=BS, enforce_eager=False)
    execute, graphs, close_graphs = engine._execute, engine.graphs, engine.graphs.close
    inside, release, done = threading.Event(), threading.Event(), threading.Event()
    freed_mid_step, got = [], []

    def held_step(step, g):
        if not step.graph:  # the prefill
            return execute(step, g)
        engine._execute = execute  # the first graph step stops inside, as a long replay would
        inside.set()
        release.wait(30)
        try:
            return execute(step, g)
        finally:
            done.set()

    def record_close():
        freed_mid_step.append(not done.is_set())
        close_graphs()

    graphs.close, engine._execute = record_close, held_step
    worker = threading.Thread(target=lambda: got.append(_generate(engine, prompt, 3)))
    closer = threading.Thread(target=engine.close)
    worker.start()
    try:
        assert inside.wait(30)
        closer.start()
        closer.join(30 if kept else 0.5)  # it gave up after wait_s; it still waits
        assert closer.is_alive() is not kept
        assert freed_mid_step == [] and engine.graphs is graphs  # nothing freed under the step
    finally:
        release.set()
        worker.join(30)
        if closer.ident is not None:
            closer.join(30)
    assert got == [want]
    assert (engine.graphs is graphs) is kept and freed_mid_step == ([] if kept else [False])
    engine.close()


def test_a_step_that_fails_on_rank_0_stops_the_ranks_and_every_later_step(tp_tiny) -> None:
    """Rank 0 fails inside a step the others have started: they may be in its collectives, out of
    step for good. The ranks are stopped, and every later step fails with the reason."""
    engine = s14.InferenceEngine(tp_tiny, max_batch_size=2, block_size=BS, tensor_parallel_size=2)
    execute = engine._execute

    def fail_once(step, graphs):
        engine._execute = execute
        raise MemoryError("no room")

    try:
        engine._execute = fail_once
        with pytest.raises(MemoryError):
            _generate(engine, [_ids(5, seed=4)], 3)
        assert not any(p.is_alive() for p in engine.tp.workers)
        with pytest.raises(RuntimeError, match="out of step"):
            _generate(engine, [_ids(5, seed=5)], 3)
    finally:
        engine.close()


def test_a_rank_that_dies_on_its_way_up_is_an_error_at_once(tmp_path) -> None:
    """A script without `if __name__ == "__main__":`: spawn runs it again in rank 1, which dies
    starting ranks of its own. Rank 0 waited for it in the rendezvous for START_TIMEOUT (ten
    minutes); it now watches the ranks it started while they check in."""
    script = tmp_path / "no_main_guard.py"
    script.write_text("import torch; torch.set_num_threads(1)\n"
                      "from common.loader import load_model\n"
                      "from stages import s14_tensor_parallel as s14\n"
                      "s14.InferenceEngine(load_model('tiny', device='cpu'), max_batch_size=2, tensor_parallel_size=2)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "RuntimeError: tensor parallel: rank 1 died (exit code 1) before the group formed" in done.stderr


def test_the_other_ranks_exit_when_rank_0_dies() -> None:
    """Rank 0 killed without closing: its rank waits in the step broadcast, sees the connection
    drop, and exits (it never runs on alone, holding its memory)."""
    import signal
    import time

    script = ("import os, sys, torch; torch.set_num_threads(1)\n"
              "from common.loader import load_model\n"
              "from stages import s14_tensor_parallel as s14\n"
              "e = s14.InferenceEngine(load_model('tiny', device='cpu'), max_batch_size=2, tensor_parallel_size=2)\n"
              "print(e.tp.workers[0].pid, flush=True)\n"
              "sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rank0 = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        rank1 = int(rank0.stdout.readline())
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{rank1}/stat") as f:
                    if f.read().split(")")[-1].split()[0] == "Z":
                        break  # ended (a zombie until someone reaps it)
            except OSError:
                break  # ended and reaped
            time.sleep(0.1)
        else:
            os.kill(rank1, signal.SIGKILL)
            pytest.fail("rank 1 outlived rank 0 by a minute")
    finally:
        rank0.kill()


def test_a_rank_that_dies_while_the_group_forms_is_an_error_and_leaves_the_process_as_it_was(tmp_path) -> None:
    """Rank 1 checks in, then dies inside init_process_group (the script makes it, in the child
    only): rank 0, already inside init_process_group too, waited START_TIMEOUT (ten minutes);
    now the collectives' timeout, and the error names the rank. The process gets its threads
    back and holds no group, so the next engine starts as if nothing happened."""
    script = tmp_path / "dies_in_init.py"
    script.write_text("import os, torch\n"
                      "if __name__ == '__mp_main__':  # spawn's name for this script in rank 1\n"
                      "    import torch.distributed as dist\n"
                      "    dist.init_process_group = lambda *a, **k: os._exit(3)\n"
                      "if __name__ == '__main__':\n"
                      "    import torch.distributed as dist\n"
                      "    from common.loader import load_model\n"
                      "    from stages import s14_tensor_parallel as s14\n"
                      "    from stages.s14_tensor_parallel import parallel\n"
                      "    torch.set_num_threads(2)\n"
                      "    tiny = load_model('tiny', device='cpu')\n"
                      "    try:\n"
                      "        s14.InferenceEngine(tiny, max_batch_size=2, tensor_parallel_size=2)\n"
                      "    except RuntimeError as e:\n"
                      "        print('error:', e)\n"
                      "    print('after:', torch.get_num_threads(), dist.is_initialized(), parallel._ACTIVE)\n"
                      "    print('next:', s14.InferenceEngine(tiny, max_batch_size=2).generate([]) == [])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STAGEWISE_TP_TIMEOUT_S": "3"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "error: tensor parallel: rank 1 died (exit code 3) while the group formed" in done.stdout
    assert "after: 2 False None" in done.stdout
    assert "next: True" in done.stdout
