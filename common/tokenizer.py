"""Tokenizer helpers shared by every stage: encoding, chat prompts, streaming detokenization.

The tokenizer itself is a Hugging Face one (from `common.loader`); these helpers only fix the few
choices that must be identical everywhere so that engines, the HF baseline and the benchmarks
see the same token ids.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that are not (yet) a complete UTF-8 char


def rust_tokenizer(tokenizer: Any, decoding: bool = False) -> Any | None:
    """The `tokenizers` object behind a fast HF tokenizer, where calling it gives what HF gives.

    Why: HF's `encode`/`decode` wrap the Rust call in Python that costs more than the call itself
    (SmolLM2 on this CPU: a short prompt 88 us through HF, 52 us direct; decoding a few ids 7.5 us
    against 2 us). A server pays it on every request's intake and the worker on every token.
    The wrapper does nothing else for us unless the tokenizer splits special tokens, or (when
    decoding) cleans up spaces; then, and for slow tokenizers, this is None and HF is called.
    """
    rust = getattr(tokenizer, "backend_tokenizer", None)  # only fast tokenizers have one
    if rust is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    if decoding and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return rust


# Characters past which a text is long to tokenize (SmolLM2: 64K of them take about 0.1 s on a CPU
# core): `encode` then lets other threads run meanwhile, and `stagewise serve` tokenizes it off its
# event loop, so one huge prompt does not stall every stream.
LONG_TEXT = 1 << 16


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` with add_special_tokens=False (as the posts do).

    No BOS is prepended, so a prompt's ids are exactly what the text (or chat template) says;
    chat templates already spell out their special tokens. A string that is not Unicode text (a
    lone surrogate, which JSON's "\\ud800" escape can carry) is a ValueError: the tokenizer
    itself would raise a TypeError that says nothing of the prompt.
    """
    if not isinstance(text, str):  # bytes, a number, a list of strings: the tokenizer's errors name no field
        raise ValueError(f"prompt must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt is not valid Unicode text: {exc.reason} at index {exc.start}") from None
    rust = rust_tokenizer(tokenizer)
    if rust is not None:
        if len(text) > LONG_TEXT:  # the same ids; encode_batch lets go of the GIL while Rust works, encode holds it
            return rust.encode_batch([text], add_special_tokens=False)[0].ids
        return rust.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer: Any, user_text: str) -> str:
    """`user_text` wrapped as a single user turn plus the assistant generation prompt.

    Instruct models (SmolLM2-Instruct) answer sensibly only inside their chat template; a
    tokenizer without one (GPT-2) gets the text unchanged.
    """
    if not getattr(tokenizer, "chat_template", None):
        return user_text
    messages = [{"role": "user", "content": user_text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas, one id at a time.

    Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character (CJK, emoji,
    accents); decoding such a prefix yields U+FFFD, which must never reach a client. We keep the
    vLLM `detokenize_incrementally` window: decode ids[prefix_offset:] and ids[prefix_offset:
    read_offset] and emit the difference once it no longer ends in U+FFFD. The prefix (the last
    emitted chunk) is decoded along with the new ids because some decoders (SentencePiece) render
    a token differently at the start of a string; the window keeps each step O(window), not
    O(sequence). Invariant: "".join(deltas) + flush() == tokenizer.decode(ids, skip_special_tokens)
    (exact for byte-level BPE tokenizers such as SmolLM2's and GPT-2's).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._rust = rust_tokenizer(tokenizer, decoding=True)  # two decodes a token: skip HF's wrapper
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (first id of the last emitted chunk)
        self._read_offset = 0  # ids before this are already emitted
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        """All text emitted so far (deltas and flush)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one id; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._advance(force=False)

    def flush(self) -> str:
        """Emit whatever is still held back (at the end of a sequence), even a trailing U+FFFD."""
        return self._advance(force=True)

    def _decode(self, start: int, end: int) -> str:
        decoder = self._rust if self._rust is not None else self._tokenizer
        return decoder.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _advance(self, force: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(_REPLACEMENT) and not force):
            return ""  # nothing new yet (special tokens only), or a character is still incomplete
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks.append(delta)
        return delta
