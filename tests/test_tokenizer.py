"""common.tokenizer: encoding as the posts do, chat prompts, and streaming text that never breaks a
multi-byte character yet adds up to exactly what `tokenizer.decode` gives for the whole sequence."""

from __future__ import annotations

import random

import pytest

from common.tokenizer import LONG_TEXT, IncrementalDetokenizer, chat_prompt, encode, rust_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld — café naïve façade, Ærøskøbing, São Paulo, Đà Nẵng",
    "你好,世界!今天天气很好,我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트",
    "emoji 🎉🚀 family 👩\u200d👩\u200d👧 flag 🇫🇷 ok 👍🏽!",
    "mixed: x² + y² = z², ∑ ∫ ≠ ≤ → ∞, 中文 and English 🙂 end",
    "  leading spaces\n\tand tabs\nnew lines  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's real tokenizer, as the `tiny` test model ships it."""
    from common.loader import load_model

    return load_model("tiny").tokenizer


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kw) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


def stream(tokenizer, ids: list[int]) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def test_encode_adds_no_special_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world")
    assert ids == tokenizer.encode("Hello world", add_special_tokens=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert not set(ids) & set(tokenizer.all_special_ids)
    assert encode(tokenizer, "") == []


SPECIAL_TEXTS = ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", " <|im_end|> "]


LONG = "Long text, " + "with <|im_end|> and caf\u00e9 " * 3000  # past LONG_TEXT characters: encode_batch's path


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + [LONG], ids=lambda t: t[:20])
def test_encode_skips_hf_wrapper_with_the_same_ids(tokenizer, text: str) -> None:
    """encode() calls the Rust tokenizer directly: the ids must be HF encode's, special tokens too."""
    assert rust_tokenizer(tokenizer) is not None  # SmolLM2's is a fast tokenizer: the direct path runs
    assert encode(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
    assert (len(text) > LONG_TEXT) == (text is LONG)


def test_a_string_that_is_not_unicode_text_is_a_value_error(tokenizer) -> None:
    """A lone surrogate (JSON's "\\ud800" gives one) would be the tokenizer's TypeError; a prompt
    error names the prompt. Text with every other character still encodes (TEXTS above)."""
    with pytest.raises(ValueError, match="prompt is not valid Unicode text: surrogates not allowed at index 3"):
        encode(tokenizer, "Hi \ud800 there")


@pytest.mark.parametrize("prompt", [b"Hi", 123, ["Hi"]])
def test_a_prompt_that_is_not_a_str_is_a_value_error(tokenizer, prompt: object) -> None:
    """A manager tokenizes before it validates the rest: the error must still name the prompt."""
    with pytest.raises(ValueError, match="^prompt must be a str"):
        encode(tokenizer, prompt)  # type: ignore[arg-type]


def test_hf_is_called_where_its_wrapper_changes_the_result(tokenizer) -> None:
    """split_special_tokens changes encoding and clean_up_tokenization_spaces decoding: HF's wrapper
    does that part, so those tokenizers (and slow ones, with no Rust backend) go through HF."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.split_special_tokens = True
    text = SPECIAL_TEXTS[0]
    assert rust_tokenizer(tok) is None
    assert encode(tok, text) == tok.encode(text, add_special_tokens=False) != encode(tokenizer, text)
    tok = copy.deepcopy(tokenizer)
    tok.clean_up_tokenization_spaces = True
    assert rust_tokenizer(tok) is not None and rust_tokenizer(tok, decoding=True) is None
    assert rust_tokenizer(CountingTokenizer(tokenizer)) is None  # no backend_tokenizer: HF's calls


def test_chat_prompt_uses_the_template(tokenizer) -> None:
    text = chat_prompt(tokenizer, "What is 2+2?")
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert "What is 2+2?" in text and text.rstrip().endswith("assistant")


def test_chat_prompt_without_template_is_the_text() -> None:
    class NoTemplate:
        chat_template = None

    assert chat_prompt(NoTemplate(), "plain text") == "plain text"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_breaks_a_char(tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    deltas, rest, detok = stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text
    assert "".join(deltas) + rest == full
    assert detok.text == full
    assert not any("\ufffd" in d for d in deltas)
    assert rest == ""  # the text ends on a complete character, so nothing was held back
    # every intermediate state is a prefix of the final text (nothing is ever retracted)
    so_far = ""
    for d in deltas:
        so_far += d
        assert full.startswith(so_far)


def test_multibyte_chars_are_held_until_complete(tokenizer) -> None:
    ids = encode(tokenizer, "你好")
    assert len(ids) > 2  # byte-level BPE splits these characters over several tokens
    deltas, rest, _ = stream(tokenizer, ids)
    assert [d for d in deltas if d] == ["你", "好"]  # each character as soon as it is complete
    assert deltas.count("") == len(ids) - 2 and rest == ""


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = encode(tokenizer, "<|im_start|>assistant\nHi 你好<|im_end|>")
    assert set(ids) & set(tokenizer.all_special_ids)
    deltas, rest, _ = stream(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nHi 你好"


def test_random_id_sequences(tokenizer) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    # ids whose text alone is an incomplete UTF-8 fragment: the hard cases, mixed in often
    fragments = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    assert len(fragments) > 50
    for _ in range(300):
        n = rng.randint(1, 40)
        ids = [rng.choice(fragments) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(n)]
        deltas, rest, detok = stream(tokenizer, ids)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + rest == full, ids
        assert detok.text == full
        assert not any(d.endswith("\ufffd") for d in deltas), ids


def test_flush_is_for_the_end_and_idempotent(tokenizer) -> None:
    ids = encode(tokenizer, "abc 你")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids[:-1]]  # stop inside the multi-byte character
    assert "".join(deltas) == "abc "
    assert detok.flush() == "\ufffd"  # a cut-off sequence: what decode() also shows
    assert detok.flush() == ""
    assert detok.text == "abc \ufffd" == tokenizer.decode(ids[:-1])
    # at a character boundary, flush() emits nothing and the stream can go on
    detok = IncrementalDetokenizer(tokenizer)
    clean = encode(tokenizer, "abc ")
    out = [detok.add(i) for i in clean] + [detok.flush()] + [detok.add(i) for i in ids[len(clean):]]
    assert "".join(out) + detok.flush() == tokenizer.decode(ids) and detok.token_ids == ids


def test_each_step_decodes_a_small_window(tokenizer) -> None:
    ids = encode(tokenizer, " ".join(TEXTS) * 10)
    assert len(ids) > 500
    counting = CountingTokenizer(tokenizer)
    deltas, rest, _ = stream(counting, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids)
    assert max(counting.lengths) <= 12  # bounded by the longest character, not the sequence
    assert len(counting.lengths) <= 2 * len(ids) + 1
