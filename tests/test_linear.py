"""Projections through packed oneDNN weights (common/linear.py) give F.linear's products.

Why: on a CPU in fp32 every projection of every stage goes through the packed weight, so a
wrong layout, a dropped bias or a shape it mishandles would break every stage at once; and
where packing is not used (bf16, CUDA, an op that is missing) `F.linear` must take over.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from common import linear as lin
from common.loader import load_model


def _onednn_packed_linear_available() -> bool:
    """Does this torch build have oneDNN's packed linear at all? Asked of the platform, not of
    common.linear (whose own check compares its results: a broken packed path must fail the tests
    below, not skip them): the ops exist and run on a trivial input, whatever they return."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), 1)
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


ONEDNN = _onednn_packed_linear_available()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
def test_common_linear_uses_the_packed_path_where_the_platform_has_it() -> None:
    # _packing_works() also compares linear() with F.linear: False here means packed products are wrong.
    assert lin._packing_works()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("shape", [(1, 40), (16, 40), (3, 7, 40), (2048, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_projection_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(*shape, generator=gen)
    packed = lin.pack(w)
    assert packed is not None
    out = lin.linear(x, w, b, packed)
    assert out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice, as a split of a fused projection gives)
    wide = torch.randn(5, 80, generator=gen)
    torch.testing.assert_close(lin.linear(wide[:, :40], w, b, packed), F.linear(wide[:, :40], w, b),
                               rtol=1e-5, atol=1e-5)


def test_fp32_weights_are_packed_and_bf16_ones_only_on_bf16_units(monkeypatch) -> None:
    w = torch.randn(8, 4)
    assert lin.pack(w.half()) is None
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: False)  # bf16 emulated: F.linear stays
    assert lin.pack(w.to(torch.bfloat16)) is None
    x = torch.randn(2, 4)
    assert torch.equal(lin.linear(x, w, None, None), F.linear(x, w))  # no packed weight: plain F.linear
    monkeypatch.setattr(lin, "_packing_works", lambda dtype=torch.float32: False)  # a torch without the op
    assert lin.pack(w) is None
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: True)
    assert lin.pack(w.to(torch.bfloat16)) is None  # units, but no op that agrees: still F.linear


@pytest.mark.skipif(not ONEDNN or not lin.cpu_has_bf16_units() or not lin._packing_works(torch.bfloat16),
                    reason="this CPU or torch has no bf16 packed linear")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_packed_bf16_projection_equals_f_linear_to_bf16_rounding(rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 40, generator=gen).to(torch.bfloat16)
    packed = lin.pack(w)
    assert packed is not None
    torch.testing.assert_close(lin.linear(x, w, None, packed).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("units", [False, True])
def test_the_model_packs_every_projection_in_fp32_and_in_bf16_on_bf16_units(monkeypatch, units: bool) -> None:
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: units)
    fp32 = load_model("tiny", device="cpu", dtype="float32").model
    bf16 = load_model("tiny", device="cpu", dtype="bfloat16").model
    if ONEDNN:
        assert all(set(layer.packed) == set(layer.PROJECTIONS) for layer in fp32.layers)
        assert fp32.lm_head_packed is not None
    if units and ONEDNN and lin._packing_works(torch.bfloat16):
        assert all(set(layer.packed) == set(layer.PROJECTIONS) for layer in bf16.layers)
        assert bf16.lm_head_packed is not None and bf16.lm_head_packed.dtype == torch.bfloat16
    else:
        assert all(not layer.packed for layer in bf16.layers) and bf16.lm_head_packed is None


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_go_through_f_linear_and_more_through_the_packed_weight(monkeypatch, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    packed = lin.pack(w)
    plain: list[int] = []  # rows of each call that went through F.linear
    monkeypatch.setattr(lin, "F", types.SimpleNamespace(linear=lambda x, w, b: plain.append(x.numel() // 40) or F.linear(x, w, b)))
    for shape in [(1, 40), (2, 40), (1, 2, 40), (3, 40), (1, 3, 40), (4, 40), (2, 2, 40), (5, 40), (0, 40)]:
        x = torch.randn(*shape, generator=gen)
        plain.clear()
        out = lin.linear(x, w, b, packed, unpacked_rows=3)
        rows = x.numel() // 40
        assert plain == ([rows] if rows <= 3 else []), shape
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    plain.clear()
    lin.linear(torch.randn(1, 40), w, b, packed)  # unpacked_rows 0, the default: packed at every size
    assert plain == []


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN packed linear")
def test_the_model_takes_f_linear_in_every_projection_up_to_its_rows(monkeypatch, tiny) -> None:
    calls: list[int] = []
    real = lin.F.linear
    monkeypatch.setattr(lin, "F", types.SimpleNamespace(linear=lambda x, w, b=None: calls.append(1) or real(x, w, b)))
    model, measured = tiny.model, tiny.model.unpacked_rows

    def one_row_forward() -> None:  # attention left out: q stands in for its output
        with torch.inference_mode():
            model(torch.tensor([[5]]), torch.tensor([[0]]), lambda layer, q, k, v: q)

    try:
        model.set_unpacked_rows(dict.fromkeys(measured, 1))
        one_row_forward()
        assert len(calls) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer, then the lm_head
        calls.clear()
        model.set_unpacked_rows({"o": 1, "lm_head": 1})
        one_row_forward()
        assert len(calls) == len(model.layers) + 1
        calls.clear()
        model.set_unpacked_rows({})
        one_row_forward()
        assert calls == []
    finally:
        model.set_unpacked_rows(measured)  # the fixture is the session's


def test_the_rows_setting_is_auto_or_a_number_of_rows(monkeypatch, tiny) -> None:
    assert lin.f_linear_rows_setting({}) is None and lin.f_linear_rows_setting({lin.ROWS_ENV: "auto"}) is None
    assert lin.f_linear_rows_setting({lin.ROWS_ENV: "0"}) == 0 and lin.f_linear_rows_setting({lin.ROWS_ENV: " 3 "}) == 3
    for bad in ("5", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=lin.ROWS_ENV):
            lin.f_linear_rows_setting({lin.ROWS_ENV: bad})
    # set: the model takes it for every projection, and measures nothing
    import common.model as model_module

    measured = tiny.model.unpacked_rows
    try:
        with monkeypatch.context() as m:
            m.setenv(lin.ROWS_ENV, "2")
            m.setattr(model_module, "rows_for_f_linear", lambda groups: pytest.fail("measured despite the setting"))
            tiny.model.pack_weights()
            assert set(tiny.model.unpacked_rows.values()) == {2}
    finally:
        tiny.model.pack_weights()  # the fixture is the session's: packed and measured again, as loaded
    assert tiny.model.unpacked_rows == measured


class _Clock:
    """A fake `time` for `rows_for_f_linear`: each `linear` call advances it by what `cost` says."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, []

    def perf_counter(self) -> float:
        return self.now


def _timed(monkeypatch, cost) -> _Clock:
    clock = _Clock()

    def fake_linear(x, w, b=None, packed=None, unpacked_rows=0):
        clock.calls.append((int(w.shape[0]), x.shape[0], packed is not None))
        clock.now += cost(int(w.shape[0]), x.shape[0], packed is not None, len(clock.calls))
        return x

    monkeypatch.setattr(lin, "time", clock)
    monkeypatch.setattr(lin, "linear", fake_linear)
    return clock


def test_rows_for_f_linear_keeps_the_rows_where_f_linear_was_clearly_faster(monkeypatch) -> None:
    # One weight per group, told apart by its rows: 1 -> faster through F.linear up to 2 rows,
    # 2 -> packed faster, 3 -> F.linear only 5 % faster (inside the margin), 4 -> no packed weight.
    def cost(out: int, rows: int, packed: bool, n: int) -> float:
        if packed:
            return 1.0
        return {1: 0.6 if rows <= 2 else 1.5, 2: 1.3, 3: 0.95, 4: 0.1}[out]

    clock = _timed(monkeypatch, cost)
    monkeypatch.setattr(lin, "MEASURE_MIN_BYTES", 0)
    groups = {f"g{out}": [(torch.zeros(out, 8), None, None if out == 4 else torch.zeros(1))] for out in (1, 2, 3, 4)}
    assert lin.rows_for_f_linear(groups) == {"g1": 2, "g2": 0, "g3": 0, "g4": 0}
    # rows 1 to 3 were tried (g1 lost at 3); never a group without packed weights; six passes a row count
    assert sorted({r for _, r, _ in clock.calls}) == [1, 2, 3]
    assert all(out != 4 for out, _, _ in clock.calls)
    assert sum(1 for out, r, _ in clock.calls if out == 1 and r == 1) == 6


def test_rows_for_f_linear_leaves_out_each_paths_warm_up_pass(monkeypatch) -> None:
    # F.linear's first pass is slow (a library's first call), packed's first pass fast: neither counts.
    seen: dict[bool, int] = {True: 0, False: 0}

    def cost(out: int, rows: int, packed: bool, n: int) -> float:
        seen[packed] += 1
        if seen[packed] == 1:
            return 100.0 if not packed else 0.01
        return 1.0 if packed else (0.5 if rows == 1 else 2.0)

    _timed(monkeypatch, cost)
    monkeypatch.setattr(lin, "MEASURE_MIN_BYTES", 0)
    assert lin.rows_for_f_linear({"g": [(torch.zeros(4, 8), None, torch.zeros(1))]}) == {"g": 1}


def test_small_weights_are_not_measured_and_large_ones_only_in_their_first_layers(monkeypatch, tiny) -> None:
    clock = _timed(monkeypatch, lambda *a: 1.0)
    small = [(torch.zeros(64, 64), None, torch.zeros(1))] * 3  # 48 KiB, in any cache
    assert lin.rows_for_f_linear({"g": small}) == {"g": 0} and clock.calls == []
    monkeypatch.setattr(lin, "MEASURE_MIN_BYTES", 0)
    monkeypatch.setattr(lin, "MEASURE_MAX_BYTES", 2 * 64 * 64 * 4)  # two of the layers' weights
    layers = [(torch.zeros(64, 64), None, torch.zeros(1)) for _ in range(5)]
    lin.rows_for_f_linear({"g": layers})
    assert len(clock.calls) == 6 * 2  # six passes over the first two layers
    # so the tiny test model's projections are packed at every row count, run after run (unless pinned)
    assert set(tiny.model.unpacked_rows.values()) == {lin.f_linear_rows_setting() or 0}


@pytest.mark.parametrize("stage", ["s02_kv_cache", "s14_tensor_parallel"])
def test_f_linear_at_few_rows_keeps_greedy_tokens_equal_to_transformers(stage, tiny, hf_greedy) -> None:
    from common.requests import Request, SamplingParams
    from conftest import stage_module

    measured = tiny.model.unpacked_rows
    tiny.model.set_unpacked_rows({name: lin.MAX_UNPACKED_ROWS for name in measured})  # decode at 1-2 rows: F.linear
    try:
        engine = stage_module(stage).InferenceEngine(tiny, max_batch_size=2)
        prompts = ["Hello", "The capital of France is", "def fibonacci(n):"]
        requests = [Request(prompt=p, params=SamplingParams(max_new_tokens=8)) for p in prompts]
        for comp in engine.generate(requests):
            assert comp.token_ids == hf_greedy(comp.prompt_token_ids, 8), comp.prompt
    finally:
        tiny.model.set_unpacked_rows(measured)  # the fixture is the session's


@pytest.mark.parametrize(("text", "expected"), [
    ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n", "GenuineIntel"),
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\n", "AuthenticAMD"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", ""),  # Arm: no vendor_id line
    (None, ""),  # no /proc/cpuinfo (not Linux)
])
def test_cpu_vendor_reads_proc_cpuinfo(tmp_path, monkeypatch, text, expected) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    if text is not None:
        cpuinfo.write_text(text)
    real_path = lin.Path
    monkeypatch.setattr(lin, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert lin.cpu_vendor.__wrapped__() == expected  # past the process's cache
