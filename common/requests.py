"""Request types: the public API that tests, docs, benchmarks and outside scripts use.

Every stage takes `Request`s and returns `Completion`s, so these types never change between
stages. Validation lives here (not in engines) so that every stage rejects bad input the same way,
before doing any work, with a `ValueError` whose message starts with the offending field's name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

# torch.Generator.manual_seed accepts this range; checking here gives a clear error up front.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(x: Any) -> bool:
    """True for Python/numpy ints but not bools (True would silently mean 1).

    A plain int is answered before the ABC check, which costs ~10x more: a server checks every
    id of every token-id prompt it is sent."""
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def int_knob(name: str, value: Any, minimum: int) -> int:
    """`value`, an engine's or a manager's knob, if it is an int >= minimum; else a ValueError
    naming the knob. Not `int(value)`: that turns 2.5 into 2 and "4" into 4 without a word, and
    None into a TypeError that names nothing."""
    if not _is_int(value) or value < minimum:
        rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {rule} (an int), got {value!r}")
    return int(value)


def _is_real(x: Any) -> bool:
    return type(x) is float or type(x) is int or (isinstance(x, Real) and not isinstance(x, bool))


def float_knob(name: str, value: Any, minimum: float = 0.0) -> float:
    """`value`, a knob in milliseconds or the like, if it is a finite real number >= minimum; else
    a ValueError naming the knob (`float("x")` or `float(None)` would name nothing)."""
    if not _is_real(value) or not minimum <= float(value) < math.inf:
        raise ValueError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `do_sample=False` (the default, like HF `generate`) or `temperature == 0` (below 1e-5) means greedy.
    `top_k == 0` and `top_p == 1.0` switch those filters off.

    The last two say what happens when a request does not fit the model's context window
    (`max_model_len`). The defaults do what the posts do: a prompt longer than the window keeps
    its last tokens, and generation ends ("length") where the window does, whatever
    `max_new_tokens` said. OpenAI's API, and vLLM's and SGLang's servers, answer such a request
    with a 400 instead, so `stagewise serve` sets both to False (the second only when the client
    gave `max_tokens`: a default it never asked for still ends at the window). A refusal is a
    `ContextLengthExceeded` naming the field.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # in (0, 1]
    do_sample: bool = False  # False (or temperature == 0) = greedy
    stop_on_eos: bool = True
    seed: int | None = None  # per-request generator seed; None = the global torch RNG
    truncate_prompt: bool = True  # False: a prompt that leaves no room for one new token is refused
    clip_max_new_tokens: bool = True  # False: prompt + max_new_tokens beyond the window is refused

    @classmethod
    def of(cls, params: "SamplingParams | None", sampling: dict[str, Any]) -> "SamplingParams":
        """What an `add_request(..., params=None, **sampling)` means: `params`, or the fields given
        as keywords (max_new_tokens=..., as the posts write it). Not both: the keywords beside
        `params` would be dropped without a word."""
        if params is not None and sampling:
            raise ValueError(f"{', '.join(sorted(sampling))}: give sampling fields as params or as keywords, not both")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(sampling) - set(names))
        if unknown:  # max_tokens (the HTTP name) for max_new_tokens: a ValueError naming it, not a TypeError
            raise ValueError(f"{', '.join(unknown)}: not a sampling field (they are {', '.join(names)})")
        return params if params is not None else cls(**sampling)

    def validate(self) -> None:
        """Raise ValueError("<field> ...") for the first invalid field."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}")
        if not isinstance(self.stop_on_eos, bool):
            raise ValueError(f"stop_on_eos must be a bool, got {self.stop_on_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be an int (64-bit) or None, got {self.seed!r}")
        for name in ("truncate_prompt", "clip_max_new_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """Greedy rows take the argmax; temperature 0 is the usual API spelling of greedy. So is any
        temperature under SAMPLING_EPS, as in vLLM: dividing fp32 logits by 1e-45 gives inf, and
        the softmax of inf is NaN, which no sampler can draw from."""
        return not self.do_sample or self.temperature < SAMPLING_EPS


@dataclass
class Request:
    """One generation request: text and/or token ids (token ids win when both are given).

    `submit_offset_s` is a benchmark's plan, not part of generation: the streaming runners
    submit the request that many seconds after the run starts (a late arrival); None follows
    the runner's own schedule. Offline `generate()` takes every request at once and ignores it.
    """

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    submit_offset_s: float | None = None

    def validate(self) -> None:
        """Raise ValueError naming the field: "prompt ...", "prompt_token_ids ...", or a params field."""
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str or None, got {type(self.prompt).__name__}")
        ids = self.prompt_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            bad = next((t for t in ids if not _is_int(t) or t < 0), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids must be non-negative ints, got {bad!r}")
        if not ids and not self.prompt:
            raise ValueError("prompt is empty: give a non-empty prompt or non-empty prompt_token_ids")
        offset = self.submit_offset_s
        if offset is not None and (not _is_real(offset) or not math.isfinite(offset) or offset < 0):
            raise ValueError(f"submit_offset_s must be a finite number >= 0 or None, got {offset!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        self.params.validate()


@dataclass
class Completion:
    """The result of one request. Timestamps are `time.perf_counter()` seconds."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) | "length" | "cancelled" (SchedulerManager.cancel or close)
    token_timestamps: list[float] = field(default_factory=list)  # one per generated token
    truncated: bool = False  # prompt was cut to its last max_model_len tokens
    # any subset of: "submitted", "tokenized", "scheduled" (prefill start), "first_token", "finished"
    timings: dict[str, float] = field(default_factory=dict)
    prompt: str | None = None


class ContextLengthExceeded(ValueError):
    """A request that does not fit the context window, refused because its params asked for that
    (`truncate_prompt=False`, `clip_max_new_tokens=False`). `field` is "prompt" or "max_new_tokens",
    so a server can answer with its own name for it; the message starts with it, like every
    ValueError here."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail

    def __reduce__(self) -> tuple:  # crosses a process boundary (common/serve/engine_process.py) intact
        return type(self), (self.field, self.detail)


@dataclass
class PreparedPrompt:
    """Token ids an engine can run, and whether the prompt had to be cut to fit."""

    token_ids: list[int]
    truncated: bool


def prepare_prompt(request: Request, tokenizer: Any, max_model_len: int) -> PreparedPrompt:
    """Validate `request` and turn it into at most `max_model_len` token ids.

    A prompt longer than the context window keeps its LAST `max_model_len` tokens (as the posts
    do): the end of the prompt is what the next token depends on most; unless its params say to
    refuse what does not fit (`ContextLengthExceeded`, see SamplingParams). Ids outside the tokenizer's
    vocabulary are rejected here because the embedding lookup would otherwise fail deep inside a
    batched forward, taking the other requests of the batch down with it.
    """
    from common.tokenizer import encode  # local: keeps `import common.requests` light

    if not _is_int(max_model_len) or max_model_len <= 0:
        raise ValueError(f"max_model_len must be > 0, got {max_model_len!r}")
    request.validate()
    if request.prompt_token_ids:
        ids = [int(t) for t in request.prompt_token_ids]
        vocab = len(tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids contains {bad}, outside the tokenizer vocabulary [0, {vocab})"
            )
    else:
        ids = encode(tokenizer, request.prompt or "")
        if not ids:
            raise ValueError(f"prompt encodes to no tokens: {request.prompt!r}")
    check_fits(request.params, len(ids), max_model_len)
    truncated = len(ids) > max_model_len
    if truncated:
        ids = ids[-max_model_len:]
    return PreparedPrompt(token_ids=ids, truncated=truncated)


def check_fits(params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """Raise ContextLengthExceeded where `params` ask to refuse what the window cannot hold.

    The window holds the prompt and every generated token but the last (which is sampled, never
    fed back): as vLLM and SGLang count it, prompt + max_new_tokens <= max_model_len, and so a
    prompt needs at least one free position."""
    if not params.truncate_prompt and prompt_len >= max_model_len:
        raise ContextLengthExceeded(
            "prompt", f"has {prompt_len} tokens; the model's context window is {max_model_len} tokens "
            f"(max_model_len), so a prompt may have at most {max_model_len - 1}")
    if not params.clip_max_new_tokens and prompt_len + params.max_new_tokens > max_model_len:
        raise ContextLengthExceeded(
            "max_new_tokens", f"is {params.max_new_tokens}, more than the {max_model_len - prompt_len} tokens left "
            f"after the prompt's {prompt_len}: the model's context window is {max_model_len} tokens (max_model_len)")


def finish_reason_for(
    token_id: int,
    num_generated: int,
    total_len: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    max_model_len: int,
) -> str | None:
    """Why a sequence stops after emitting `token_id`, or None to keep going.

    `num_generated` counts `token_id`; `total_len` = prompt + generated tokens. Stopping at
    `total_len >= max_model_len` is HF's MaxLengthCriteria with max_length = the context window,
    so the last token is never fed back at a position the model does not have. EOS wins over
    length when both apply.
    """
    if params.stop_on_eos and token_id in eos_token_ids:
        return "stop"
    if num_generated >= params.max_new_tokens or total_len >= max_model_len:
        return "length"
    return None
