"""`stagewise profile-decode`: the window holds exactly the decode steps asked for, and each op lands in its group."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.bench import profile_decode, profiling


@pytest.mark.parametrize("stage, flags", [pytest.param(s, [], id=s) for s in ("2", "3", "9", "11", "12")]
                         + [pytest.param("12", ["--no-enforce-eager"], id="12-padded")])
def test_profile_decode_on_tiny(stage: str, flags: list[str], tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    assert profile_decode.main(["--stage", stage, "--model", "tiny", "--device", "cpu", "--dtype", "float32",
                                "--batch", "3", "--prompt-len", "9", "--steps", "4", "--json", str(out), *flags]) == 0
    r = json.loads(out.read_text())
    assert "x floor" in capsys.readouterr().out
    # Every step of the window runs each projection once: the window is exactly `steps` steps.
    # (oneDNN's op where the model packed its weights, as it does on a CPU in fp32; else aten::mm)
    mm = [row for row in r["ops"] if row["group"] == "matmul"]
    assert len(mm) == 1 and mm[0]["calls_per_step"] == pytest.approx(r["matmuls_per_step"])
    assert len(r["step_samples_ms"]) == 4 and r["decode_step_ms"] > 0 and r["floor_ms"] > 0
    # The groups are the op rows' (the shares are those over their sum, 1 in all by construction):
    # every listed op sits in its name's group, and the one matmul op is the whole matmul group.
    assert all(row["group"] == profiling.group_of(row["op"]) for row in r["ops"])
    assert r["groups_ms_profiled"]["matmul"] == pytest.approx(mm[0]["ms_per_step"])
    assert r["groups_ms_profiled"]["matmul"] > 0 and r["groups_ms_profiled"]["attention"] > 0
    if stage != "2":  # the paged stages gather their blocks
        assert r["groups_ms_profiled"]["kv_cache"] > 0
    assert r["env"]["git_commit"] and r["stage"].startswith(f"s{int(stage):02d}_")
    # The K/V the window's steps read: prompt + the 4 skipped steps + the middle of 4 timed ones + the new token.
    assert r["kv_context_tokens"] == pytest.approx(9 + 4 + 1.5 + 1) and r["kv_read_floor_ms"] > 0
    kv_ms = r["groups_ms_profiled"]["attention"] + r["groups_ms_profiled"]["kv_cache"]
    assert r["attention_vs_kv_read_floor"] == pytest.approx(kv_ms / r["kv_read_floor_ms"])
    # The forward without attention is measured between the windows (it calls the model too, and
    # the window above still holds 4 steps) and gives the bound with the K/V read floor.
    assert r["attention_free_step_ms"] > 0
    assert r["x_floor_bound"] == pytest.approx((r["attention_free_step_ms"] + r["kv_read_floor_ms"]) / r["floor_ms"])


@pytest.mark.parametrize("stage, batch, steps", [("11", 32, 3), ("12", 64, 20)])
def test_profile_decode_finds_the_full_batch_under_chunked_prefill(stage: str, batch: int, steps: int,
                                                                   tmp_path: Path) -> None:
    """Stage 11 on, a batch whose prompts take several chunked steps: the first prompts decode while
    the last are prefilled (their rows take part of each step's budget), and the window still
    holds `steps` full-batch decode steps, and only those."""
    out = tmp_path / "profile.json"
    assert profile_decode.main(["--stage", stage, "--model", "tiny", "--device", "cpu", "--dtype", "float32",
                                "--batch", str(batch), "--prompt-len", "64", "--steps", str(steps),
                                "--json", str(out), *(["--no-enforce-eager"] if stage == "12" else [])]) == 0
    r = json.loads(out.read_text())
    # (oneDNN's op where the model packed its weights, as it does on a CPU in fp32; else aten::mm)
    mm = [row for row in r["ops"] if row["group"] == "matmul"]
    assert len(mm) == 1 and mm[0]["calls_per_step"] == pytest.approx(r["matmuls_per_step"])
    assert len(r["step_samples_ms"]) == steps


class _Model(torch.nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()


class _Graphs:
    """Stage 12's `DecodeGraphs.run` in two forms: a replay, which never calls the model (a CUDA
    graph), and the CPU path, which calls it with the padded batch's rows."""

    def __init__(self, model: torch.nn.Module, replay: bool) -> None:
        self.model, self.replay = model, replay

    def run(self, ids: list[int]) -> torch.Tensor:
        G = 1 << (len(ids) - 1).bit_length()  # the bucket: the batch padded to a power of two
        return torch.zeros(len(ids)) if self.replay else self.model(torch.tensor([ids + [0] * (G - len(ids))]))  # [1, G]


class _Engine:
    def __init__(self, model: torch.nn.Module, graphs: _Graphs, batch: int, steps: int) -> None:
        self.model, self.graphs, self.batch, self.steps = model, graphs, batch, steps

    def generate(self, requests: list) -> None:
        self.model(torch.zeros((1, 21), dtype=torch.long))  # a prefill: more tokens than rows, no decode step
        for _ in range(self.steps):
            self.graphs.run([0] * self.batch)


@pytest.mark.parametrize("replay, batch", [(True, 3), (False, 3), (False, 4)])
def test_the_window_counts_each_decode_step_once_whether_a_graph_replays_it_or_not(replay: bool, batch: int) -> None:
    """A step that replays a CUDA graph never calls the model: the window starts it at the graphs'
    `run`. Where `run` calls the model (the CPU path; padded, or not when the batch fills its
    bucket), the step is still one."""
    model = _Model()
    engine = _Engine(model, _Graphs(model, replay), batch, steps=12)
    window = profile_decode.DecodeWindow(model, steps=5, batch=batch, device=torch.device("cpu"), graphs=engine.graphs)
    times = window.run(engine, [], profiled=True)
    assert len(window.starts) == 12 and len(times) == 5
    window.prof.key_averages()  # the profiler ran over the window (it raises if it never started)
    engine.steps = 6  # too few steps for the window: a clear error, not the profiler's
    with pytest.raises(RuntimeError, match=f"saw 6 decode steps of {batch} rows; the window needs 10"):
        window.run(engine, [], profiled=True)
    assert not torch.autograd._profiler_enabled()  # the profiler that run started is stopped


def test_groups() -> None:
    assert profiling.group_of("aten::mm") == "matmul"
    assert profiling.group_of("aten::index_select") == "kv_cache"
    assert profiling.group_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert profiling.group_of("aten::_cudnn_attention_forward") == "attention"  # SDPA's CUDA backend, as the H200 named it
    assert profiling.group_of("aten::rsqrt") == "other"


def test_ops_of_known_names_and_times_give_the_groups_and_their_ms() -> None:
    """A profile with ops of known names and times (us over 4 steps) -> each group's ms per step."""
    from types import SimpleNamespace as Row

    class Prof:
        def key_averages(self):
            return [Row(key="mkldnn::_linear_pointwise", self_cpu_time_total=8000.0, count=360),
                    Row(key="aten::addmm", self_cpu_time_total=400.0, count=4),
                    Row(key="aten::_scaled_dot_product_flash_attention_for_cpu", self_cpu_time_total=2000.0, count=120),
                    Row(key="aten::index_select", self_cpu_time_total=1200.0, count=240),
                    Row(key="aten::index_copy_", self_cpu_time_total=400.0, count=240),
                    Row(key="aten::rsqrt", self_cpu_time_total=600.0, count=244),
                    Row(key="aten::slice", self_cpu_time_total=200.0, count=500),
                    Row(key="tensor_parallel::all_reduce", self_cpu_time_total=400.0, count=8),  # stage 14's span
                    Row(key="aten::empty", self_cpu_time_total=0.0, count=9)]  # no own time: not an op row

    ops = profiling.op_table(Prof(), steps=4)
    assert [(r["op"], r["group"]) for r in ops] == [
        ("mkldnn::_linear_pointwise", "matmul"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::index_select", "kv_cache"), ("aten::rsqrt", "other"), ("aten::addmm", "matmul"),
        ("aten::index_copy_", "kv_cache"), ("tensor_parallel::all_reduce", "communication"),
        ("aten::slice", "other")]  # largest first
    fields = profiling.group_fields(ops)
    assert fields["groups_ms_profiled"] == pytest.approx({"matmul": 2.1, "attention": 0.5, "kv_cache": 0.4,
                                                          "communication": 0.1, "other": 0.2})
    assert fields["profiled_ms"] == pytest.approx(3.3)
    assert fields["groups_share"] == pytest.approx({"matmul": 2.1 / 3.3, "attention": 0.5 / 3.3, "kv_cache": 0.4 / 3.3,
                                                    "communication": 0.1 / 3.3, "other": 0.2 / 3.3})
    assert profiling.group_fields([])["groups_share"] == {
        g: 0.0 for g in ("matmul", "attention", "kv_cache", "communication", "other")}


def test_op_table_counts_kernel_time_under_the_op_that_launched_it() -> None:
    """On CUDA a kernel has its own row (no CPU time) and its time is also its launching op's own
    device time: the table keeps the ops, each with its launch cost and its kernels' time."""
    from types import SimpleNamespace as Row

    class Prof:
        def key_averages(self):
            return [Row(key="aten::mm", self_cpu_time_total=400.0, self_device_time_total=3000.0, count=8),
                    Row(key="aten::add", self_cpu_time_total=200.0, self_device_time_total=100.0, count=4),
                    Row(key="ampere_sgemm_64x64", self_cpu_time_total=0.0, self_device_time_total=3000.0, count=8)]

    rows = profiling.op_table(Prof(), steps=2, kernels=True)
    assert [(r["op"], r["ms_per_step"], r["kernel_ms_per_step"], r["calls_per_step"]) for r in rows] == [
        ("aten::mm", 0.2, 1.5, 4.0), ("aten::add", 0.1, 0.05, 2.0)]
    assert all("kernel_ms_per_step" not in r for r in profiling.op_table(Prof(), steps=2))

    class Replayed(Prof):  # a CUDA graph's replay: its kernels' rows, launched by no op
        def key_averages(self):
            return super().key_averages() + [
                Row(key="vectorized_elementwise_kernel", self_cpu_time_total=0.0, self_device_time_total=100.0, count=4),
                Row(key="ampere_sgemm_64x64", self_cpu_time_total=0.0, self_device_time_total=5000.0, count=20)]

    rows = profiling.op_table(Replayed(), steps=2, kernels=True)
    assert [(r["op"], r["kernel_ms_per_step"]) for r in rows] == [
        ("aten::mm", 1.5), ("aten::add", 0.05), (profiling.GRAPH_KERNELS, pytest.approx(2.5))]
    assert profiling.kernel_fields(rows)["kernel_ms_per_step"] == pytest.approx(4.05)  # the GPU's whole time
    assert profiling.graph_replays(rows) and not profiling.graph_replays(profiling.op_table(Prof(), 2, kernels=True))


def test_a_replayed_profile_reports_no_group_comparisons_and_an_eager_bound() -> None:
    """Stage 12's profile from an H200: its groups saw 0 ms of matmuls, which read as '0.00x the
    floor'; a replayed step is below the eager bound. Read as recorded (`graph_replays`) and as a
    file from before that field was (its op rows say it)."""
    r = json.loads((Path(__file__).parents[1] / "docs/results/cuda/profile.s12_cuda_graphs.b64.gpt2-random.cuda.json").read_text())
    assert r["groups_ms_profiled"]["matmul"] == 0 and r["x_floor"] < r["x_floor_bound"]
    assert r.get("graph_replays", True) and profiling.graph_replays(r["ops"])
    older = {k: v for k, v in r.items() if k != "graph_replays"}
    for report in (r, older):
        text = profile_decode.format_profile(report, top=5)
        assert "replayed CUDA graphs" in text and "can go below" in text
        assert "Matmuls in the step vs" not in text and "attention and KV cache ops took" not in text
    eager = dict(r, graph_replays=False, matmul_vs_floor=0.0, attention_vs_kv_read_floor=0.0)  # as an eager step's reads
    assert "Matmuls in the step vs" in profile_decode.format_profile(eager, top=5)


def test_kv_bytes_and_the_read_floor() -> None:
    """SmolLM2's shapes (30 layers, 3 KV heads of 64): 16 rows of 180 tokens in fp32 are ~133 MB a step."""
    from types import SimpleNamespace

    import torch

    from common.bench.floor import kv_bytes_per_step, read_floor_ms

    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    assert kv_bytes_per_step(smollm2, 16, 180, 4) == 2 * 30 * 16 * 180 * 3 * 64 * 4 == 132_710_400
    assert kv_bytes_per_step(smollm2, 16, 180, 2) * 2 == kv_bytes_per_step(smollm2, 16, 180, 4)
    assert read_floor_ms(1 << 16, torch.float32, torch.device("cpu"), repeats=3) > 0
    with pytest.raises(ValueError, match="nbytes"):
        read_floor_ms(0, torch.float32, torch.device("cpu"))


def test_attention_free_forward_is_one_token_per_row_and_reads_no_kv(tiny) -> None:
    """attention_free_ms times the model's own forward, one token for each of B rows with the last
    row's logits only, and an attention that hands back q: no K/V anywhere (common/bench/floor.py)."""
    from common.bench.floor import attention_free_ms

    model, calls = tiny.model, []
    forward = model.forward

    def spy(ids, positions, attention, logits_indices=None):
        out = attention(0, *(torch.randn(ids.shape[0], 1, h, model.config.head_dim)
                             for h in (model.config.num_heads, model.config.num_kv_heads, model.config.num_kv_heads)))
        calls.append((tuple(ids.shape), tuple(positions.shape), tuple(out.shape), tuple(logits_indices.shape)))
        return forward(ids, positions, attention, logits_indices=logits_indices)

    model.forward = spy
    try:
        assert attention_free_ms(model, 5, warmup=2, repeats=3) > 0
    finally:
        del model.forward
    H = model.config.num_heads
    assert calls == [((5, 1), (5, 1), (5, 1, H, model.config.head_dim), (5,))] * 5  # 2 warm-ups + 3 timed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_free_forward_runs_the_projections_as_a_step_does(dtype) -> None:
    """The no-op attention hands back its queries in a tensor of their own, as a real attention
    does: the output projection gets plain rows. Handed q's strided view, a bf16 forward on a
    CPU ran every projection after it as a batched matmul over a copy of the weight per row, and
    the "least x floor" bound read 19x instead of about 1.2x."""
    from torch.profiler import profile

    from common.bench.floor import _no_attention
    from common.loader import load_model

    model = load_model("tiny", device="cpu", dtype=dtype).model
    B = 8
    ids, positions, first = torch.arange(B)[:, None], torch.ones((B, 1), dtype=torch.long), torch.zeros(B, dtype=torch.long)
    with torch.inference_mode(), profile() as prof:
        model(ids, positions, _no_attention, logits_indices=first)
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::bmm", "aten::expand"}, sorted(ops)
