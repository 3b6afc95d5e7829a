"""Fixtures shared by tests/ and every stage's test_stage.py.

The `tiny` model (random weights, SmolLM2's real tokenizer) keeps the suite fast on a
2-core CPU; `hf_greedy` is the reference every stage is checked against: Hugging Face
transformers' `generate`, run one prompt at a time.

`STAGEWISE_TEST_DEVICE=cuda make test` runs the same tests on a GPU: `tiny`, its transformers
twin and the server's model then live there, in fp32 (the parity tests compare tokens exactly,
which bf16, CUDA's default dtype, would not allow). Unset, everything runs on the CPU, as in CI.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TEST_DEVICE = os.environ.get("STAGEWISE_TEST_DEVICE", "cpu")  # cpu | cuda | cuda:N
STAGE_DIRS = sorted(p.name for p in (Path(__file__).parent / "stages").glob("s[0-9]*_*") if (p / "__init__.py").exists())


def pytest_configure(config) -> None:
    """A device the machine does not have stops the run at once, not in every test's fixture."""
    if TEST_DEVICE != "cpu":
        from common.loader import resolve_device

        try:
            resolve_device(TEST_DEVICE)
        except ValueError as exc:
            raise pytest.UsageError(f"STAGEWISE_TEST_DEVICE: {exc}") from None


def stage_module(name: str):
    return importlib.import_module(f"stages.{name}")


def load_script(name: str):
    """scripts/<name>.py as a module: scripts/ is no package, so its tests load each file by path.
    Registered in sys.modules under its name, as an import would be (torch.compile looks a
    module's functions up there)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def streaming_packages() -> list[str]:
    """The registry's packages of every stage that streams through a SchedulerManager (04 on)."""
    from common import stages as registry

    return [p for p in registry.STAGES.values() if hasattr(registry.load_stage(p), "SchedulerManager")]


def burst_packages() -> list[str]:
    """The streaming stages whose OnlineScheduler admits a burst in one add_requests call (06 on)."""
    from common import stages as registry

    return [p for p in streaming_packages() if hasattr(registry.load_stage(p).OnlineScheduler, "add_requests")]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny batches on a shared 2-core box: torch's intra-op threads would only fight over the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny():
    from common.loader import load_model

    return load_model("tiny", device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session")
def hf_tiny(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32).to(tiny.device).eval()


def run_hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids) -> list[int]:
    """transformers' greedy `generate` on one prompt (no padding), stopping at EOS."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=hf_model.device)
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=list(eos_token_ids), pad_token_id=list(eos_token_ids)[0],
            temperature=None, top_p=None, top_k=None,
        )
    gen = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(gen):  # generate pads finished rows; cut at the first EOS (kept, as we do)
        if t in eos_token_ids:
            return gen[: i + 1]
    return gen


@pytest.fixture(scope="session")
def hf_greedy(tiny, hf_tiny):
    """Memoised reference: hf_greedy(prompt_ids, max_new_tokens) -> token ids."""
    memo: dict[tuple, list[int]] = {}

    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in memo:
            memo[key] = run_hf_greedy(hf_tiny, list(prompt_ids), max_new_tokens, tiny.config.eos_token_ids)
        return memo[key]

    return run
