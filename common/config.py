"""ModelConfig: the few numbers our decoder needs, read from a Hugging Face config.

Why a config of our own: every stage, the KV cache sizing and the benchmarks need the same
handful of shapes (layers, KV heads, head_dim, ...). Hugging Face configs spell them differently
per architecture (`n_embd` vs `hidden_size`, `rope_parameters` vs the legacy `rope_theta` /
`rope_scaling`), so we normalise them once here and refuse what the model cannot compute
(unknown RoPE types, sliding windows, ...) instead of silently computing something else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" (Llama/SmolLM2/TinyLlama/Llama-3/Mistral/Qwen2) or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # == num_heads for MHA / gpt2
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None (plain RoPE) or {"rope_type": "llama3", ...}
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    o_proj_bias: bool = False  # Llama configs with attention_bias=True also bias o_proj

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> "ModelConfig":
        """Build from a transformers config object (or its dict form).

        `generation_config` (a GenerationConfig or dict, optional) contributes extra EOS ids:
        HF `generate` stops on the generation config's EOS, which can differ from the model
        config's (Llama-3 instruct lists several), so we keep the union.
        """
        cfg = SimpleNamespace(**hf_config) if isinstance(hf_config, Mapping) else hf_config
        model_type = getattr(cfg, "model_type", None)
        eos = _eos_ids(getattr(cfg, "eos_token_id", None), _get(generation_config, "eos_token_id"))
        if model_type == "gpt2":
            return cls._from_gpt2(cfg, eos)
        if model_type not in LLAMA_FAMILY:
            raise ValueError(
                f"model_type: {model_type!r} is not supported (supported: {', '.join(LLAMA_FAMILY + ('gpt2',))})"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only silu (SwiGLU) is supported, got {act!r}")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias: MLP biases are not supported")
        if model_type == "qwen2" and getattr(cfg, "use_sliding_window", False):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        # Mistral's `sliding_window` is ignored: identical results while sequences fit in the window.
        num_heads = cfg.num_attention_heads
        rope_theta, rope_scaling = _parse_rope(cfg)
        qkv_bias = model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        return cls(
            arch="llama",
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            norm_eps=float(cfg.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            eos_token_ids=eos,
            o_proj_bias=model_type == "llama" and bool(getattr(cfg, "attention_bias", False)),
        )

    @classmethod
    def _from_gpt2(cls, cfg: Any, eos: tuple[int, ...]) -> "ModelConfig":
        act = getattr(cfg, "activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation_function: only tanh-approximated GELU is supported, got {act!r}")
        if not getattr(cfg, "scale_attn_weights", True) or getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError("scale_attn_weights: only the standard 1/sqrt(head_dim) scale is supported")
        hidden = cfg.n_embd
        return cls(
            arch="gpt2",
            vocab_size=cfg.vocab_size,
            hidden_size=hidden,
            num_layers=cfg.n_layer,
            num_heads=cfg.n_head,
            num_kv_heads=cfg.n_head,
            head_dim=hidden // cfg.n_head,
            intermediate_size=getattr(cfg, "n_inner", None) or 4 * hidden,
            max_position_embeddings=cfg.n_positions,
            norm_eps=float(cfg.layer_norm_epsilon),
            tie_word_embeddings=True,  # GPT2LMHeadModel always ties lm_head to wte
            eos_token_ids=eos,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read config.json (+ generation_config.json when present) from an HF-format directory."""
        from transformers import AutoConfig

        path = Path(path)
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_hf(hf_config, gen)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers: what a KV cache pays per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """Union of EOS ids (each an int, a list of ints or None), first-seen order."""
    out: list[int] = []
    for value in values:
        items: Iterable[Any] = [] if value is None else ([value] if isinstance(value, int) else value)
        for item in items:
            if int(item) not in out:
                out.append(int(item))
    return tuple(out)


def _parse_rope(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or the legacy fields."""
    params = getattr(cfg, "rope_parameters", None)
    legacy_theta = getattr(cfg, "rope_theta", None)
    if isinstance(params, Mapping) and params:
        if any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
        theta = params.get("rope_theta", legacy_theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = legacy_theta
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    theta = 10000.0 if theta is None else float(theta)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0 or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_scaling: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_scaling: unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    out: dict = {"rope_type": "llama3"}
    for key in _LLAMA3_KEYS:
        value = scaling.get(key)
        if value is None and key == "original_max_position_embeddings":
            value = cfg.max_position_embeddings
        if value is None:
            raise ValueError(f"rope_scaling: llama3 RoPE needs {key!r}")
        out[key] = value
    return theta, out
