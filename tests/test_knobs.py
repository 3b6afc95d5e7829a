"""Every stage's engine and manager knobs: a value that is not one is a ValueError naming the knob.

Why: the knobs used to go through `int()`, which turns 2.5 into 2, "4" into 4 and True into 1
without a word, and None into a TypeError that names nothing (`common.requests.int_knob`).
"""
from __future__ import annotations

import inspect

import pytest

from common import stages as registry
from common.requests import int_knob
from conftest import streaming_packages

PACKAGES = list(registry.STAGES.values())
NOT_INTS = [None, 2.5, "4", True, 0, -3]


@pytest.mark.parametrize("value", [None, 2.5, "4", True, False, 0])
def test_int_knob_takes_only_an_int_at_least_its_minimum(value) -> None:
    with pytest.raises(ValueError, match=r"^block_size must be positive \(an int\), got "):
        int_knob("block_size", value, 1)
    assert int_knob("block_size", 16, 1) == 16 and int_knob("workers", 0, 0) == 0


def _engine_knobs(package: str) -> list[str]:
    params = inspect.signature(registry.load_stage(package).InferenceEngine).parameters
    return [k for k in ("max_batch_size", "block_size", "num_kv_blocks", "kv_cache_max_concurrency",
                        "prefix_cache_max_entries", "max_num_batched_tokens", "max_cudagraph_capture_size",
                        "tensor_parallel_size") if k in params]


@pytest.mark.parametrize("package", PACKAGES, ids=registry.short_name)
def test_engine_knobs_that_are_not_ints_are_refused_naming_the_knob(package, tiny) -> None:
    stage = registry.load_stage(package)
    for knob in _engine_knobs(package):
        for value in NOT_INTS:
            if knob == "prefix_cache_max_entries" and value == 0:
                continue  # 0 entries: the cache is off
            if value is None and knob in ("num_kv_blocks", "kv_cache_max_concurrency", "max_cudagraph_capture_size"):
                continue  # None: the default
            with pytest.raises(ValueError, match=f"^{knob} "):
                stage.InferenceEngine(tiny, **{knob: value})


@pytest.mark.parametrize("package", streaming_packages(), ids=registry.short_name)
def test_manager_knobs_that_are_not_ints_are_refused_naming_the_knob(package, tiny) -> None:
    stage = registry.load_stage(package)
    engine = stage.InferenceEngine(tiny, max_batch_size=2)
    params = inspect.signature(stage.SchedulerManager).parameters
    for knob, minimum in (("max_batch_size", 1), ("stream_interval", 1), ("tokenize_workers", 0),
                          ("prefill_max_batch_size", 1)):
        if knob not in params:
            continue
        for value in (2.5, "4", True, minimum - 1):
            with pytest.raises(ValueError, match=f"^{knob} "):
                stage.SchedulerManager(engine, **{knob: value})


SWITCHES = [(p, k) for p in PACKAGES for k in ("enable_prefix_caching", "enforce_eager")
            if k in inspect.signature(registry.load_stage(p).InferenceEngine).parameters]


@pytest.mark.parametrize("package, knob", SWITCHES, ids=[f"{registry.short_name(p)}-{k}" for p, k in SWITCHES])
def test_switches_take_a_bool(package, knob, tiny) -> None:
    with pytest.raises(ValueError, match=f"^{knob} must be a bool"):
        registry.load_stage(package).InferenceEngine(tiny, **{knob: "no"})


@pytest.mark.parametrize("package", [p for p in PACKAGES if "block_size" in _engine_knobs(p)], ids=registry.short_name)
def test_a_kv_pool_larger_than_memory_is_refused_naming_its_knobs_before_it_is_allocated(package, tiny) -> None:
    """A billion blocks used to reach the allocator's per-block lists and die there, naming nothing."""
    stage = registry.load_stage(package)
    for knobs in ({"num_kv_blocks": 10**12}, {"kv_cache_max_concurrency": 10**9}, {"block_size": 10**10}):
        blocks = knobs.get("num_kv_blocks", r"\d+")  # the count asked for (stages 12+ add a pad block to it)
        with pytest.raises(ValueError, match=rf"^the KV pool \(num_kv_blocks={blocks}, block_size=\d+\) needs .* GiB of "
                                             r"cpu memory: lower num_kv_blocks, kv_cache_max_concurrency or block_size "):
            stage.InferenceEngine(tiny, max_batch_size=2, **knobs)
