"""Hugging Face checkpoints: which files hold the tensors, and the tensors renamed into our layout.

`DecoderModel` (model.py) keeps its weights under its own names and shapes: q, k and v (and gate
and up) concatenated into one weight each, so each is a single matmul, and GPT-2's Conv1D weights
transposed to `[out, in]`. The functions here map a checkpoint's tensors onto those, taking each
by name so that a missing weight, or one the model would silently ignore, is an error. Stage 14's
ranks read their shares of the same files (`safetensors_files`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from .config import ModelConfig


def safetensors_files(path: Path) -> list[str]:
    """The checkpoint's files in `path`: `model.safetensors`, or the shards named in its index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(f"model: no model.safetensors (or index) in {path}")


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of the checkpoint in `path`."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for name in safetensors_files(path):
        state.update(load_file(path / name))
    return state


class _Taker:
    """Pops tensors by HF name so that leftovers (weights we'd silently ignore) are an error."""

    IGNORED = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")

    def __init__(self, state: Mapping[str, Tensor], prefix: str) -> None:
        self.state = state  # read by name only: a lazy mapping reads just the tensors taken
        self.names = {(k[len(prefix):] if k.startswith(prefix) else k): k for k in state}

    def __call__(self, name: str) -> Tensor:
        if name not in self.names:
            raise ValueError(f"model: checkpoint is missing weight {name!r}")
        return self.state[self.names.pop(name)]

    def finish(self, config: ModelConfig) -> None:
        if config.tie_word_embeddings:  # some tied checkpoints still store a copy
            self.names.pop("lm_head.weight", None)
        left = [k for k in self.names if not k.endswith(self.IGNORED)]
        if left:
            raise ValueError(f"model: checkpoint has weights this model does not use: {left[:5]}")


def llama_state_dict(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    take = _Taker(hf, "model.")
    out = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    for i in range(config.num_layers):
        p = o = f"layers.{i}."
        attn = lambda n: take(f"{p}self_attn.{n}")  # noqa: E731
        out[o + "qkv_weight"] = torch.cat([attn("q_proj.weight"), attn("k_proj.weight"), attn("v_proj.weight")])
        if config.attention_bias:
            out[o + "qkv_bias"] = torch.cat([attn("q_proj.bias"), attn("k_proj.bias"), attn("v_proj.bias")])
        out[o + "o_weight"] = attn("o_proj.weight")
        if config.o_proj_bias:
            out[o + "o_bias"] = attn("o_proj.bias")
        out[o + "gate_up_weight"] = torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
        out[o + "down_weight"] = take(f"{p}mlp.down_proj.weight")
        out[o + "input_layernorm.weight"] = take(f"{p}input_layernorm.weight")
        out[o + "post_attention_layernorm.weight"] = take(f"{p}post_attention_layernorm.weight")
    if not config.tie_word_embeddings:
        out["lm_head"] = take("lm_head.weight")
    take.finish(config)
    return out


def gpt2_state_dict(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    take = _Taker(hf, "transformer.")
    out = {
        "embed_tokens.weight": take("wte.weight"),
        "embed_positions.weight": take("wpe.weight"),
        "norm.weight": take("ln_f.weight"),
        "norm.bias": take("ln_f.bias"),
    }
    names = {"attn_weight": "attn.c_attn.weight", "attn_proj_weight": "attn.c_proj.weight",
             "fc_weight": "mlp.c_fc.weight", "mlp_proj_weight": "mlp.c_proj.weight"}
    for i in range(config.num_layers):
        for ours, theirs in names.items():  # Conv1D stores [in, out]; F.linear wants [out, in]
            out[f"layers.{i}.{ours}"] = take(f"h.{i}.{theirs}").t().contiguous()
            out[f"layers.{i}.{ours.replace('weight', 'bias')}"] = take(f"h.{i}.{theirs.replace('weight', 'bias')}")
        for ln in ("ln_1", "ln_2"):
            out[f"layers.{i}.{ln}.weight"] = take(f"h.{i}.{ln}.weight")
            out[f"layers.{i}.{ln}.bias"] = take(f"h.{i}.{ln}.bias")
    take.finish(config)
    return out
