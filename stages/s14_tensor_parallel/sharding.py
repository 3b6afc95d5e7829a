"""A rank's share of the model: which slice of every checkpoint tensor it reads, and the model made of them.

Megatron-LM's split (Shoeybi et al., 2019), as vLLM, SGLang, nano-vllm and mini-sglang do it.
Each rank opens the checkpoint's safetensors files memory-mapped and reads only its own slices
(`ShardReader`), so no rank ever holds the whole model, and builds a `DecoderModel` of its
share's shapes from them (`load_shard`):

- column-parallel, the matrices that spread the hidden state out: the rows of q/k/v for this
  rank's heads (H/N query heads, Hkv/N KV heads) and its 1/N of the gate/up (GPT-2: c_fc) rows.
  Each rank owns whole heads: RoPE, the KV cache and attention need no communication;
- row-parallel, the matrices that bring it back: the matching columns of the output and down
  projections. Each rank's product is a partial sum of the hidden state; one all-reduce adds
  them up (a bias counts once: rank 0 holds it, the others hold zeros);
- vocabulary-parallel: rows [r V/N, (r+1) V/N) of the embedding and of the LM head (tied or
  not), the vocabulary padded with zero rows to a multiple of N. A token outside a rank's rows
  looks up zeros and an all-reduce completes the embedding; the LM head's slices of the logits
  are gathered on rank 0, which samples.

Norms and GPT-2's position embedding are small and every rank reads them whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from common.checkpoint import safetensors_files
from common.config import ModelConfig
from common.model import DecoderModel

if TYPE_CHECKING:
    from .parallel import TensorParallel

Span = tuple[int, int]  # [start, end) along one dimension of a checkpoint tensor
WHOLE, BIAS_ON_RANK_0, VOCAB = "whole", "bias on rank 0", "vocab"
ROW_PARALLEL = {"llama": ("o", "down"), "gpt2": ("attn_proj", "mlp_proj")}  # the blocks' projections that all-reduce


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes of one rank's share: its heads, its slice of the MLP and of the vocabulary."""
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size,
                               vocab_size=-(-config.vocab_size // size))


class ShardReader(Mapping[str, Tensor]):
    """A checkpoint's tensors by Hugging Face name, each read as rank `rank`'s slice of it.

    `DecoderModel.from_hf_state` takes tensors from it one by one, as from a whole checkpoint;
    only the slices are read from disk (`bytes_read` counts them)."""

    def __init__(self, path: Path, config: ModelConfig, rank: int, size: int) -> None:
        from safetensors import safe_open

        self.config, self.rank, self.size = config, rank, size
        self._files = [safe_open(str(path / name), framework="pt") for name in safetensors_files(path)]
        self._file_of = {name: f for f in self._files for name in f.keys()}
        self.rules = self._rules()
        self.bytes_read = 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def rule(self, name: str) -> tuple[int, list[Span]] | str:
        """How rank r cuts the tensor `name`: (dimension, spans to join), or WHOLE, BIAS_ON_RANK_0, VOCAB."""
        return next((rule for suffix, rule in self.rules.items() if name.endswith(suffix)), WHOLE)

    def _rules(self) -> dict[str, tuple[int, list[Span]] | str]:
        """This rank's cut of every kind of tensor, by the end of its Hugging Face name."""
        c, n, r = self.config, self.size, self.rank

        def mine(total: int, offset: int = 0) -> Span:  # rank r's 1/n of `total` values, from `offset`
            return offset + r * total // n, offset + (r + 1) * total // n

        q, kv, inner = mine(c.num_heads * c.head_dim), mine(c.num_kv_heads * c.head_dim), mine(c.intermediate_size)
        E = c.num_heads * c.head_dim
        return {
            # Llama: nn.Linear stores [out, in]: column-parallel cuts rows (dim 0), row-parallel columns (dim 1)
            ".q_proj.weight": (0, [q]), ".q_proj.bias": (0, [q]),
            ".k_proj.weight": (0, [kv]), ".k_proj.bias": (0, [kv]),
            ".v_proj.weight": (0, [kv]), ".v_proj.bias": (0, [kv]),
            ".o_proj.weight": (1, [q]), ".o_proj.bias": BIAS_ON_RANK_0,
            ".gate_proj.weight": (0, [inner]), ".up_proj.weight": (0, [inner]), ".down_proj.weight": (1, [inner]),
            # GPT-2: Conv1D stores [in, out], the other way round; c_attn holds q, k and v side by side
            ".attn.c_attn.weight": (1, [q, mine(E, E), mine(E, 2 * E)]),
            ".attn.c_attn.bias": (0, [q, mine(E, E), mine(E, 2 * E)]),
            ".attn.c_proj.weight": (0, [q]), ".attn.c_proj.bias": BIAS_ON_RANK_0,
            ".mlp.c_fc.weight": (1, [inner]), ".mlp.c_fc.bias": (0, [inner]),
            ".mlp.c_proj.weight": (0, [inner]), ".mlp.c_proj.bias": BIAS_ON_RANK_0,
            "embed_tokens.weight": VOCAB, "wte.weight": VOCAB, "lm_head.weight": VOCAB,
        }

    def __getitem__(self, name: str) -> Tensor:
        whole = self._file_of[name].get_slice(name)  # nothing read yet
        rule = self.rule(name)
        if rule == VOCAB:  # rows [r per, (r+1) per), the padding past the vocabulary zeros
            vocab, per = whole.get_shape()[0], -(-self.config.vocab_size // self.size)
            start, end = min(self.rank * per, vocab), min((self.rank + 1) * per, vocab)
            t = whole[start:end]
            self.bytes_read += t.numel() * t.element_size()
            if end - start < per:
                t = torch.cat([t, t.new_zeros(per - (end - start), *t.shape[1:])])
            return t
        if rule == BIAS_ON_RANK_0 and self.rank != 0:
            return torch.zeros(whole.get_shape(), dtype=whole[:1].dtype)
        if rule in (WHOLE, BIAS_ON_RANK_0):
            t = whole[:]
        else:
            dim, spans = rule
            t = torch.cat([whole[a:b] if dim == 0 else whole[:, a:b] for a, b in spans], dim=dim)
        self.bytes_read += t.numel() * t.element_size()
        return t


def load_shard(tp: "TensorParallel", path: Path, config: ModelConfig, device: torch.device,
               dtype: torch.dtype) -> DecoderModel:
    """This rank's share of the model at `path`, read from the checkpoint, its collectives in place:
    an all-reduce after each row-parallel projection and after the embedding, and the LM head's
    slices of the logits gathered on rank 0."""
    reader = ShardReader(path, config, tp.rank, tp.size)
    model = DecoderModel.from_hf_state(local_config(config, tp.size), reader, device, dtype)
    tp.bytes_loaded = reader.bytes_read
    for layer in model.layers:
        _row_parallel(layer, ROW_PARALLEL[config.arch], tp)
    per = model.config.vocab_size
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, tp.rank * per, tp)
    local_head = model.project_lm_head

    def project_lm_head(x: Tensor) -> Tensor:  # [..., E] -> rank 0: [..., V], every rank's slice joined
        return tp.gather_last(local_head(x))[..., :config.vocab_size]  # (the padding cut; elsewhere [..., V / n])

    model.project_lm_head = project_lm_head
    return model


def _row_parallel(layer: nn.Module, names: tuple[str, ...], tp: "TensorParallel") -> None:
    """The layer's `names` projections give partial sums of the hidden state: all-reduce them."""
    project = layer.project

    def reduced(name: str, x: Tensor) -> Tensor:
        out = project(name, x)
        return tp.all_reduce(out) if name in names else out

    layer.project = reduced


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them looks up zeros, and the ranks'
    lookups are summed: every token is found by exactly one rank."""

    def __init__(self, weight: Tensor, start: int, tp: "TensorParallel") -> None:
        super().__init__()
        self.weight = weight  # [V / n, E]: the LM head's too, when tied
        self.start, self.tp = start, tp

    def forward(self, ids: Tensor) -> Tensor:  # [B, T] -> [B, T, E]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[..., None], 0.0))
