"""Our DecoderModel computes what transformers computes: logits within float noise, same greedy tokens.

Each architecture path is checked against Hugging Face on the same saved weights: the `tiny` Llama,
a Qwen2-style model (q/k/v bias), GPT-2 (Conv1D weights, learned positions) and a Llama with
Llama-3.1 RoPE scaling; plus one forward of the real default model, smollm2-135m.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import ModelConfig
from common.loader import load_model
from common.model import DecoderModel

ATOL = 1e-4  # fp32 noise: HF's own eager vs sdpa paths differ by ~2e-5 on `tiny`
PROMPT_IDS = [[1, 504, 3458, 282, 4649, 314, 30, 2767, 11, 20, 33, 9, 12090, 19, 42, 7, 7, 7, 2030, 315]]


class ReferenceAttention:
    """Causal SDPA over exactly the tokens passed in (no KV cache): the simplest correct backend."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # [B, T, H, D]


class CachingAttention:
    """Appends K/V per layer so a forward can continue where the previous one stopped."""

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=1)
            v = torch.cat([self.v[layer_idx], v], dim=1)
        self.k[layer_idx], self.v[layer_idx] = k, v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        t_q, t_k = q.shape[2], k.shape[2]
        mask = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _our_logits(model: DecoderModel, ids: list[list[int]]) -> Tensor:
    x = torch.tensor(ids)
    positions = torch.arange(x.shape[1]).expand_as(x)
    with torch.inference_mode():
        return model(x, positions, ReferenceAttention())


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_logits(path: Path, ids: list[list[int]]) -> Tensor:
    with torch.inference_mode():
        return _hf_model(path)(torch.tensor(ids)).logits


def _assert_parity(path: Path, ids: list[list[int]] = PROMPT_IDS) -> None:
    ours = _our_logits(DecoderModel.from_pretrained(path), ids)
    ref = _hf_logits(path, ids)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max |ours - hf| = {diff}"


def _save_random(model, path: Path) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name or "ln_" in name else 0.05) + ("norm" in name))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("tiny", device="cpu")


def test_tiny_logits_match_hf(tiny_loaded):
    _assert_parity(tiny_loaded.path)


def test_tiny_batch_and_logits_indices(tiny_loaded):
    ids = [PROMPT_IDS[0][:12], PROMPT_IDS[0][8:]]
    full = _our_logits(tiny_loaded.model, ids)  # [2, 12, V]
    x = torch.tensor(ids)
    idx = torch.tensor([11, 4])
    with torch.inference_mode():
        picked = tiny_loaded.model(x, torch.arange(12).expand_as(x), ReferenceAttention(), logits_indices=idx)
    assert picked.shape == (2, tiny_loaded.config.vocab_size)
    torch.testing.assert_close(picked, full[torch.arange(2), idx], atol=ATOL, rtol=0)
    torch.testing.assert_close(full, _hf_logits(tiny_loaded.path, ids), atol=ATOL, rtol=0)


def test_positions_drive_rope_incremental_forward(tiny_loaded):
    """Prefix, then the rest with positions offset: same logits as one full forward."""
    ids = torch.tensor(PROMPT_IDS)
    full = _our_logits(tiny_loaded.model, PROMPT_IDS)
    attn = CachingAttention()
    with torch.inference_mode():
        tiny_loaded.model(ids[:, :13], torch.arange(13)[None], attn)
        rest = tiny_loaded.model(ids[:, 13:], torch.arange(13, ids.shape[1])[None], attn)
    torch.testing.assert_close(rest, full[:, 13:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("cudnn", [False, True])
def test_attention_runs_with_sdpa_cudnn_as_the_model_says_and_the_flags_come_back(tiny_loaded, monkeypatch, cudnn,
                                                                                 captured):
    """cuDNN's SDPA made an H200's eager steps several times slower: our forwards leave it out
    (`DecoderModel.cudnn_attention`), and a forward a CUDA graph captures follows its own flag
    (`cudnn_attention_captured`), only while they run, touching no other backend's flag. The
    flags are torch's global ones, so this catches on a CPU what a GPU would pick."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seen: list[tuple[bool, bool]] = []
    flags = torch.backends.cuda

    def attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        seen.append((flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled()))
        return ReferenceAttention()(layer_idx, q, k, v)

    monkeypatch.setattr(tiny_loaded.model, "cudnn_attention_captured" if captured else "cudnn_attention", cudnn)
    monkeypatch.setattr(tiny_loaded.model, "cudnn_attention" if captured else "cudnn_attention_captured", not cudnn)
    x = torch.tensor(PROMPT_IDS)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):  # a caller's choice
        tiny_loaded.model(x, torch.arange(x.shape[1]).expand_as(x), attention, captured=captured)
        assert flags.cudnn_sdp_enabled() and not flags.flash_sdp_enabled()  # the caller's, given back
    assert seen == [(cudnn, False)] * tiny_loaded.config.num_layers


def test_tiny_greedy_matches_hf_generate(tiny_loaded):
    hf = _hf_model(tiny_loaded.path)
    tok = tiny_loaded.tokenizer
    for text in ["Hello, my name is", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)
        expected = expected[0, len(ids):].tolist()
        out: list[int] = []
        for _ in range(10):  # full recompute every step, stopping on EOS like generate
            nxt = int(_our_logits(tiny_loaded.model, [ids + out])[0, -1].argmax())
            out.append(nxt)
            if nxt in tiny_loaded.config.eos_token_ids:
                break
        assert out == expected, text


def test_tiny_config(tiny_loaded):
    cfg = tiny_loaded.config
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 64, 2, 4, 2)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_ids) == (49152, 128, (2,))
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    assert tiny_loaded.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_qwen2_bias_matches_hf(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=[3, 5])
    path = _save_random(Qwen2ForCausalLM(cfg), tmp_path / "qwen2")
    config = ModelConfig.from_pretrained(path)
    assert config.attention_bias and not config.o_proj_bias and config.rope_theta == 1e6
    assert set(config.eos_token_ids) == {3, 5}
    _assert_parity(path, [[i * 7 % 512 for i in range(1, 30)]])


def test_gpt2_matches_hf(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=48, n_layer=2, n_head=4)
    path = _save_random(GPT2LMHeadModel(cfg), tmp_path / "gpt2")
    assert ModelConfig.from_pretrained(path).arch == "gpt2"
    _assert_parity(path, [[i * 11 % 300 for i in range(40)], [i * 3 % 300 for i in range(40)]])


def test_llama3_rope_scaling_matches_hf(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                      rope_parameters=rope, tie_word_embeddings=True)
    path = _save_random(LlamaForCausalLM(cfg), tmp_path / "llama3")
    assert ModelConfig.from_pretrained(path).rope_scaling["rope_type"] == "llama3"
    _assert_parity(path, [[i * 5 % 256 for i in range(100)]])


def test_unknown_rope_type_is_rejected():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf(cfg)


def test_legacy_rope_fields():
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "eos_token_id": [7, 8],
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    }, {"eos_token_id": [8, 9]})
    assert cfg.rope_theta == 500000.0 and cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert cfg.eos_token_ids == (7, 8, 9)


def test_smollm2_logits_match_hf():
    loaded = load_model("smollm2-135m", device="cpu")
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = [tok(text, add_special_tokens=False)["input_ids"]]
    ours = _our_logits(loaded.model, ids)
    ref = _hf_logits(loaded.path, ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"max |ours - hf| = {diff}"
    assert torch.equal(ours[0].argmax(-1), ref[0].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_hf_rope_to_the_bit(tiny_loaded, dtype):
    """apply_rope rolls x and keeps rotate_half's minus sign in sin (common/model.py): the
    rotated q and k must be transformers' own, bit for bit, in fp32 and in bf16."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from common.model import apply_rope

    model, hf_config = tiny_loaded.model, AutoConfig.from_pretrained(tiny_loaded.path)
    B, T, H, Hkv, D = 3, 7, 9, 3, model.config.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)  # ours: [B, T, H, D]
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    positions = torch.randint(0, 500, (B, T), generator=g)
    cos, sin = model.rope_cos_sin(positions, dtype)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(q, positions)  # [B, T, D] in q's dtype
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)  # [B, H, T, D]
    assert torch.equal(apply_rope(q, cos, sin), hf_q.transpose(1, 2))
    assert torch.equal(apply_rope(k, cos, sin), hf_k.transpose(1, 2))
