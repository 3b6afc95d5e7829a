"""DecoderModel: our own forward for Llama-family models and GPT-2, with pluggable attention.

Why our own forward: the whole point of the stages is *how K/V are stored and read* (no cache in
01, contiguous in 02, paged from 03 on). So the model computes everything except attention and
calls `attention(layer_idx, q, k, v)` once per layer; each stage passes its own backend.
Everything else mirrors the Hugging Face implementations op for op (same RMSNorm cast order,
same RoPE formula) so our logits match transformers' to float noise and greedy tokens match exactly.

Three load-time choices for speed, all invisible to callers: q/k/v (and gate/up) projections are
concatenated into one weight so each is a single matmul; GPT-2's Conv1D weights (stored
[in, out]) are transposed once so every projection is a plain linear; and on a CPU in fp32 each
weight is also packed once for oneDNN's matmul (`common/linear.py`: about 2x faster than
`F.linear` there for decode-sized inputs), except at the few rows where this machine runs
`F.linear` faster, which the model measures once at load.

Two run-time choices too. The paged stages' decode attention is SDPA, or in bf16 on a CPU over a
K/V rectangle large for that CPU the same math written out (`decode_attention`). And our eager
forwards keep SDPA off its cuDNN backend (`cudnn_attention`): on an H200 the eager steps ran
several times slower with it, and they bring new shapes all the time (the batch grows, the gathered
K/V widens, a prompt chunk has its own length), which cuDNN may plan one by one. A forward captured
into a CUDA graph (`captured=True`) has one shape, planned once at capture, and may use it
(`cudnn_attention_captured`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import gpt2_state_dict, llama_state_dict, read_safetensors
from .config import ModelConfig
from .linear import cpu_has_amx, cpu_vendor, f_linear_rows_setting, linear, pack, rows_for_f_linear


class Attention(Protocol):
    """The stage decides how K/V are stored and read. The model calls it once per layer."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D], RoPE already applied. They are views into the
        block's projection outputs, not copies: the last dim is contiguous, the others may be
        strided (reshape, don't assume `.view` works across B and T). Returns [B, T, Hq, D].
        Softmax scale is 1/sqrt(D). GQA: Hq is a multiple of Hkv."""
        ...


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """An attention mask as SDPA uses it: 0 where a query may attend a key, -inf where not.

    Why not pass the boolean mask itself: SDPA turns a boolean mask into exactly this on every
    call (two `where`s, their scalar tensors and a copy: on a GPU, kernels launched for nothing),
    and the model calls attention once per layer. A stage builds its mask once per forward, so
    it converts it there, once, in the dtype of the queries; the outputs are bit for bit the same.
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def decode_matmul_min_keys() -> int | float:
    """Rows x keys of a gathered K/V rectangle from which bf16 decode attention on a CPU is written
    out (`decode_attention`), by the CPU (scripts/decode_attention_bench.py; its results are in
    docs/results/questions/decode-matmul-attention/).

    Why it is the CPU's: the written-out form is two of oneDNN's batched matmuls, SDPA's bf16
    kernel a loop of its own, and which is faster follows how fast the CPU's bf16 matmuls are.
    On AMD's Zen 4 and Zen 5 (AVX512-BF16, no AMX) SDPA was the faster below about a thousand and
    the two cost about the same around it. On a Xeon with AMX, whose tiles SDPA's kernel uses too,
    SDPA was the faster or level up to 64 rows x 320 keys, the written-out form ahead by under a
    tenth from about 16,000 and by a fifth only from 32 x 1,024: there the threshold sits where
    the gain is clear, not where it begins. On a Xeon with AVX512-BF16 whose AMX was hidden from
    the system (no `amx` flag), where bf16 matmuls ran no faster than fp32's from 32 rows on, SDPA
    was the faster or level at every shape measured, up to 64 x 2,048: on an Intel CPU without
    AMX (that one measured) it is never written out."""
    if cpu_has_amx():
        return 32768
    if cpu_vendor() == "GenuineIntel":
        return math.inf
    return 1024


DECODE_MATMUL_MIN_KEYS = decode_matmul_min_keys()


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """One query row per sequence over its gathered K/V: q [Hkv, B, G, D]; k, v [Hkv, B, L, D];
    `mask` additive (`additive_mask`), broadcastable to [Hkv, B, G, L] -> [Hkv, B, G, D].

    SDPA, except in bf16 on a CPU over a large rectangle. There SDPA's kernel (the flash one,
    which works through the rectangle one sequence and one head at a time) took longer than the
    same math written out (`written_out_attention`): over twice as long at 64 rows on a Zen 4
    with AVX512-BF16 (`scripts/decode_attention_bench.py`; from which size on is the CPU's:
    `decode_matmul_min_keys`). fp32 always takes SDPA, so its tokens are what they were
    (transformers', bit for bit)."""
    _, B, L, _ = k.shape
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and B * L >= DECODE_MATMUL_MIN_KEYS:
        return written_out_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def written_out_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA's math as two batched matmuls around a softmax, each over the whole rectangle in one
    call; the shapes are `decode_attention`'s. In bf16 this is transformers' eager attention:
    scores rounded to bf16, the softmax accumulated in fp32, probabilities in bf16. Each row must
    see at least one key (a row of -inf scores would be NaN here, 0 in SDPA): every decode row
    does, its own new token."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)  # [Hkv, B, G, L]
    return torch.matmul(scores.softmax(-1), v)  # [Hkv, B, G, D]


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 and cast back *before* the weight multiply (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] in fp32 (HF's formula), with optional Llama-3.1 scaling.
    Computed on the CPU whatever the default device: arithmetic on the meta device, where
    `from_hf_state` builds the model, imports torch._dynamo (1-2 s of a process's start)."""
    dim = config.head_dim
    arange = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (arange.float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {scaling.get('rope_type')!r}")
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the middle blended.
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / scaling["low_freq_factor"]
    high_freq_wavelen = old_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, 1, D] from `rope_cos_sin` -> rotated x [B, T, H, D].

    HF's form is `x * cos + rotate_half(x) * sin`, with rotate_half(x) = cat(-x2, x1) for the two
    halves of D. Here the minus sign lives in sin (`rope_cos_sin` negates its first half) and
    `roll` swaps the halves: cat(x2, x1) * cat(-sin1, sin2) is HF's product to the bit (negation
    is exact), in four ops instead of seven. The block rotates q's and k's heads in one call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Projections:
    """A block's projections by name: `<name>_weight` [out, in] and `<name>_bias` (or none).

    `project` is the one place a block multiplies by a weight, so the floor (common/bench/floor.py)
    times exactly the calls a step makes, through the packed weight where `pack_weights` made one."""

    PROJECTIONS: tuple[str, ...] = ()
    packed: dict[str, Tensor]  # name -> weight packed for oneDNN (common/linear.py); empty: F.linear
    unpacked_rows: dict[str, int]  # name -> up to how many rows F.linear is the faster (measured at load)

    def projection(self, name: str) -> tuple[Tensor, Tensor | None]:
        return getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias", None)

    def project(self, name: str, x: Tensor) -> Tensor:
        weight, bias = self.projection(name)
        return linear(x, weight, bias, self.packed.get(name), self.unpacked_rows.get(name, 0))

    def pack_weights(self) -> None:
        self.packed = {n: p for n in self.PROJECTIONS if (p := pack(self.projection(n)[0])) is not None}
        self.unpacked_rows = {}  # packed at every size until the model measures (DecoderModel.pack_weights)


class LlamaBlock(nn.Module, Projections):
    """Pre-norm block: x + attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    PROJECTIONS = ("qkv", "o", "gate_up", "down")
    gate_up_bias = down_bias = None  # Llama's MLP has no biases (found here, not by a failed lookup per call)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * dim
        self.input_layernorm = RMSNorm(hidden, config.norm_eps)
        # rows: [q_proj; k_proj; v_proj] of the HF checkpoint
        self.qkv_weight = nn.Parameter(torch.empty(qkv_out, hidden))
        self.qkv_bias = nn.Parameter(torch.empty(qkv_out)) if config.attention_bias else None
        self.o_weight = nn.Parameter(torch.empty(hidden, config.num_heads * dim))
        self.o_bias = nn.Parameter(torch.empty(hidden)) if config.o_proj_bias else None
        self.post_attention_layernorm = RMSNorm(hidden, config.norm_eps)
        # rows: [gate_proj; up_proj]
        self.gate_up_weight = nn.Parameter(torch.empty(2 * config.intermediate_size, hidden))
        self.down_weight = nn.Parameter(torch.empty(hidden, config.intermediate_size))
        self.packed, self.unpacked_rows = {}, {}

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.project("qkv", self.input_layernorm(x)).view(B, T, H + 2 * Hkv, D)  # q, k, v heads
        q, k = apply_rope(qkv[:, :, :H + Hkv], cos, sin).split([H, Hkv], dim=2)  # [B, T, H | Hkv, D]
        v = qkv[:, :, H + Hkv:]  # [B, T, Hkv, D]: views, no copies (see Attention)
        out = attention(self.layer_idx, q, k, v)  # [B, T, H, D]
        x = x + self.project("o", out.reshape(B, T, H * D))
        gate, up = self.project("gate_up", self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.project("down", F.silu(gate) * up)  # [B, T, E]


class GPT2Block(nn.Module, Projections):
    """GPT-2 block: x + attn(LayerNorm(x)), then x + MLP_gelu_tanh(LayerNorm(x))."""

    PROJECTIONS = ("attn", "attn_proj", "fc", "mlp_proj")

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.ln_1 = nn.LayerNorm(hidden, eps=config.norm_eps)
        heads = config.num_heads * config.head_dim  # = hidden (a tensor-parallel rank's share: hidden / N)
        self.attn_weight = nn.Parameter(torch.empty(3 * heads, hidden))  # c_attn, transposed
        self.attn_bias = nn.Parameter(torch.empty(3 * heads))
        self.attn_proj_weight = nn.Parameter(torch.empty(hidden, heads))
        self.attn_proj_bias = nn.Parameter(torch.empty(hidden))
        self.ln_2 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.fc_weight = nn.Parameter(torch.empty(inner, hidden))
        self.fc_bias = nn.Parameter(torch.empty(inner))
        self.mlp_proj_weight = nn.Parameter(torch.empty(hidden, inner))
        self.mlp_proj_bias = nn.Parameter(torch.empty(hidden))
        self.packed, self.unpacked_rows = {}, {}

    def forward(self, x: Tensor, attention: Attention) -> Tensor:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim  # H * D = E, or E / N for one of N tensor-parallel ranks
        q, k, v = self.project("attn", self.ln_1(x)).split(H * D, dim=-1)
        q, k, v = (t.view(B, T, H, D) for t in (q, k, v))  # [B, T, H, D]: views (see Attention)
        out = attention(self.layer_idx, q, k, v)  # [B, T, H, D]
        x = x + self.project("attn_proj", out.reshape(B, T, H * D))
        h = F.gelu(self.project("fc", self.ln_2(x)), approximate="tanh")
        return x + self.project("mlp_proj", h)  # [B, T, E]


@contextmanager
def cudnn_sdpa(enabled: bool) -> Iterator[None]:
    """SDPA's cuDNN backend on or off inside the block, then as it was; the caller's choice of the
    other backends stays. torch's flag is process-wide, so one engine forwards at a time (as the
    worker thread of serve and the benches does)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class DecoderModel(nn.Module):
    """A decoder-only LM (Llama family or GPT-2) whose attention is supplied by the caller."""

    # May SDPA pick its cuDNN backend (CUDA only; fp32 never runs on it)? Not in our eager forwards: on
    # an H200, stage 13's eager steps took 225 ms with it and 38 without, and stage 09's TPOT
    # under post 052's load was 23.3 ms against 8.9 (docs/results/cuda/worker-probe.*), a plan
    # built for each new shape the likely cause. vLLM and SGLang do not use SDPA by default on
    # a GPU: they bring their own attention kernels.
    cudnn_attention: bool = False
    # ... and in a forward captured into a CUDA graph (stage 12 on)? Yes: a graph's shapes are
    # fixed, so cuDNN plans them once, at capture, and on the H200 stage 13's replays were faster
    # with it (3.72 ms a step against 4.34, cuDNN on everywhere against off everywhere).
    cudnn_attention_captured: bool = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Weights come from a checkpoint (`from_hf_state` builds the model on the meta device), so
        # no initial values: given none, nn.Embedding draws them, and on the meta device that
        # draw imports torch._dynamo (1-2 s of every process's start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList()
        if config.arch == "gpt2":
            positions = config.max_position_embeddings
            self.embed_positions = nn.Embedding(positions, config.hidden_size,
                                                _weight=torch.empty(positions, config.hidden_size))
            self.layers.extend(GPT2Block(config, i) for i in range(config.num_layers))
            self.norm: nn.Module = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        elif config.arch == "llama":
            self.layers.extend(LlamaBlock(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        else:
            raise ValueError(f"arch: unknown architecture {config.arch!r}")
        # fp32 on purpose and not a buffer, so `.to(bfloat16)` can't round the frequencies.
        self._inv_freq = rope_inv_freq(config) if config.arch == "llama" else None
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size)
        )
        self.lm_head_packed: Tensor | None = None  # see pack_weights
        self.lm_head_unpacked_rows = 0

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def project_lm_head(self, x: Tensor) -> Tensor:
        """[..., E] -> logits [..., V]."""
        return linear(x, self.lm_head_weight, None, self.lm_head_packed, self.lm_head_unpacked_rows)

    def pack_weights(self) -> "DecoderModel":
        """Pack every projection once for oneDNN where that is the faster matmul (common/linear.py),
        then measure, per projection, up to how many rows `F.linear` is the faster one here (a few
        rows on some CPUs: there a product is mostly the weights' read, see `rows_for_f_linear`).
        The packed copies sit beside the weights (a second copy in memory: 0.5 GB for SmolLM2 in
        fp32); call it again after changing a weight, device or dtype."""
        for layer in self.layers:
            layer.pack_weights()
        self.lm_head_packed = pack(self.lm_head_weight)
        groups = {name: [(*layer.projection(name), layer.packed.get(name)) for layer in self.layers]
                  for name in self.layers[0].PROJECTIONS}
        groups["lm_head"] = [(self.lm_head_weight, None, self.lm_head_packed)]
        fixed = f_linear_rows_setting()  # STAGEWISE_F_LINEAR_ROWS: the same choice in every run
        self.set_unpacked_rows(rows_for_f_linear(groups) if fixed is None else dict.fromkeys(groups, fixed))
        return self

    def set_unpacked_rows(self, rows: dict[str, int]) -> None:
        """Up to how many rows each projection (by name; "lm_head" for the last) goes through
        `F.linear` rather than its packed weight: what `pack_weights` measured, or a choice of one's own."""
        for layer in self.layers:
            layer.unpacked_rows = {n: int(rows.get(n, 0)) for n in layer.PROJECTIONS}
        self.lm_head_unpacked_rows = int(rows.get("lm_head", 0))

    @property
    def unpacked_rows(self) -> dict[str, int]:
        """Projection name -> up to how many rows it goes through `F.linear` (results record it)."""
        return {**self.layers[0].unpacked_rows, "lm_head": self.lm_head_unpacked_rows}

    def rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and the signed sin that `apply_rope` takes, [B, T, 1, D] (broadcast over heads), for
        the absolute positions [B, T]; computed in fp32 and then cast, like HF. Made once per
        forward, shared by every layer."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self._inv_freq  # [B, T, D/2]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # [B, T, D/2]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [B, T, D]: rotate_half's sign in sin
        return cos[:, :, None, :], sin[:, :, None, :]

    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        positions: Tensor,  # [B, T] absolute position of every token
        attention: Attention,
        logits_indices: Tensor | None = None,  # [B]: per row, which t to keep
        captured: bool = False,  # the forward a CUDA graph holds: fixed shapes (see cudnn_attention_captured)
    ) -> Tensor:  # [B, T, V], or [B, V] with logits_indices
        x = self.embed_tokens(input_ids)  # [B, T, E]
        with cudnn_sdpa(self.cudnn_attention_captured if captured else self.cudnn_attention):
            if self.config.arch == "gpt2":
                x = x + self.embed_positions(positions)
                for layer in self.layers:
                    x = layer(x, attention)
            else:
                cos, sin = self.rope_cos_sin(positions, x.dtype)
                for layer in self.layers:
                    x = layer(x, cos, sin, attention)
        if logits_indices is not None:
            # Only the rows we sample from pay for the norm and the (large) vocab projection.
            x = x[torch.arange(x.shape[0], device=x.device), logits_indices]  # [B, E]
        return self.project_lm_head(self.norm(x))  # [B, (T,) V]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "DecoderModel":
        """Load an HF-format directory (config.json + *.safetensors, sharded or not)."""
        path = Path(path)
        return cls.from_hf_state(ModelConfig.from_pretrained(path), read_safetensors(path), device, dtype)

    @classmethod
    def from_hf_state(
        cls, config: ModelConfig, hf_state: Mapping[str, Tensor], device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "DecoderModel":
        """Build the model from tensors by their Hugging Face names: a checkpoint's, or one
        tensor-parallel rank's share of them (stage 14), each read when it is taken, with the
        shapes of that share in `config`."""
        convert = gpt2_state_dict if config.arch == "gpt2" else llama_state_dict
        state = {k: v.to(device=device, dtype=dtype) for k, v in convert(hf_state, config).items()}
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        if model._inv_freq is not None:
            model._inv_freq = rope_inv_freq(config).to(device)
        return model.eval().requires_grad_(False).pack_weights()
