"""common.requests: validation messages name the field; prompts are prepared as the posts do."""

from __future__ import annotations

import pickle

import pytest

from common import stages as registry
from common.requests import (
    Completion,
    ContextLengthExceeded,
    PreparedPrompt,
    Request,
    SamplingParams,
    finish_reason_for,
    prepare_prompt,
)
from common.tokenizer import encode
from conftest import streaming_packages


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's real tokenizer, as the `tiny` test model ships it."""
    from common.loader import load_model

    return load_model("tiny").tokenizer


# ---------------------------------------------------------------- SamplingParams


def test_default_params_are_valid_and_greedy() -> None:
    p = SamplingParams()
    p.validate()
    assert p.greedy


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"do_sample": True}, False),
        ({"do_sample": True, "temperature": 0.0}, True),
        ({"do_sample": False, "temperature": 0.7}, True),
        ({"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}, False),
        ({"do_sample": True, "temperature": 1e-45}, True),  # under SAMPLING_EPS: logits / 1e-45 would be inf
        ({"do_sample": True, "temperature": 1e-5}, False),
    ],
)
def test_greedy_property(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_params_and_keywords_together_are_refused_naming_the_keywords() -> None:
    """add_request(params=..., max_new_tokens=0) used to drop the keyword without a word."""
    with pytest.raises(ValueError, match="^max_new_tokens, top_k: give sampling fields as params or as keywords"):
        SamplingParams.of(SamplingParams(), {"top_k": 3, "max_new_tokens": 0})
    assert SamplingParams.of(None, {"max_new_tokens": 3}).max_new_tokens == 3
    params = SamplingParams(top_k=2)
    assert SamplingParams.of(params, {}) is params


def test_an_unknown_sampling_keyword_is_a_value_error_naming_it() -> None:
    """add_request("Hi", max_tokens=5), the HTTP name, was a TypeError from the dataclass."""
    with pytest.raises(ValueError, match="^max_tokens: not a sampling field .*max_new_tokens"):
        SamplingParams.of(None, {"max_tokens": 5, "top_k": 2})


@pytest.mark.parametrize("package", streaming_packages(), ids=registry.short_name)
def test_params_and_keywords_together_fail_only_that_request(package, tiny) -> None:
    stage = registry.load_stage(package)
    with stage.SchedulerManager(stage.InferenceEngine(tiny, max_batch_size=2), max_batch_size=2) as manager:
        with pytest.raises(ValueError, match="^max_new_tokens: give sampling fields"):
            manager.add_request("Hi", params=SamplingParams(max_new_tokens=2), max_new_tokens=9).result(timeout=30)
        assert len(manager.add_request("Hi", max_new_tokens=2).result(timeout=30).token_ids) == 2


def test_max_new_tokens_message_is_exact() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(max_new_tokens=0).validate()
    assert str(err.value) == "max_new_tokens must be > 0, got 0"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1.0"),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", float("nan")),
        ("do_sample", "yes"),
        ("stop_on_eos", 1),
        ("seed", 1.5),
        ("seed", "3"),
        ("seed", True),
        ("seed", 2**64),
    ],
)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field} "):
        params.validate()
    with pytest.raises(ValueError, match=f"^{field} "):  # a Request validates its params too
        Request(prompt="hi", params=params).validate()


def test_edge_params_are_valid() -> None:
    SamplingParams(max_new_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=0).validate()
    SamplingParams(top_p=1e-6, top_k=1, seed=-5, do_sample=True, temperature=3).validate()


# ---------------------------------------------------------------- Request


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"prompt": ""}, {"prompt": None, "prompt_token_ids": []}, {"prompt": "", "prompt_token_ids": []}],
)
def test_empty_prompt_raises_naming_prompt(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="^prompt "):
        Request(**kwargs).validate()


@pytest.mark.parametrize("ids", [[1, -1], [1, 2.0], [True], "abc", 5])
def test_bad_token_ids_raise_naming_field(ids: object) -> None:
    with pytest.raises(ValueError, match="^prompt_token_ids "):
        Request(prompt_token_ids=ids).validate()  # type: ignore[arg-type]


def test_prompt_must_be_text() -> None:
    with pytest.raises(ValueError, match="^prompt "):
        Request(prompt=b"bytes").validate()  # type: ignore[arg-type]


def test_token_ids_alone_are_enough() -> None:
    Request(prompt_token_ids=[0, 5, 7]).validate()
    Request(prompt="", prompt_token_ids=(3, 4)).validate()  # type: ignore[arg-type]


def test_completion_defaults_are_not_shared() -> None:
    a = Completion([1], [2], "x", "length")
    b = Completion([1], [2], "x", "length")
    a.timings["submitted"] = 1.0
    a.token_timestamps.append(2.0)
    assert b.timings == {} and b.token_timestamps == [] and not b.truncated and b.prompt is None


# ---------------------------------------------------------------- prepare_prompt


def test_prepare_prompt_encodes_without_special_tokens(tokenizer) -> None:
    text = "The capital of France is"
    prepared = prepare_prompt(Request(prompt=text), tokenizer, max_model_len=128)
    assert prepared == PreparedPrompt(token_ids=encode(tokenizer, text), truncated=False)
    assert prepared.token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_prepare_prompt_token_ids_win(tokenizer) -> None:
    prepared = prepare_prompt(Request(prompt="ignored text", prompt_token_ids=[5, 6, 7]), tokenizer, 128)
    assert prepared == PreparedPrompt([5, 6, 7], False)


def test_prepare_prompt_keeps_the_last_positions(tokenizer) -> None:
    ids = list(range(10, 40))
    assert prepare_prompt(Request(prompt_token_ids=ids), tokenizer, 30) == PreparedPrompt(ids, False)
    assert prepare_prompt(Request(prompt_token_ids=ids), tokenizer, 8) == PreparedPrompt(ids[-8:], True)
    text = "one two three four five six seven eight nine ten " * 4
    full = encode(tokenizer, text)
    prepared = prepare_prompt(Request(prompt=text), tokenizer, 5)
    assert prepared.truncated and prepared.token_ids == full[-5:]


def test_prepare_prompt_refuses_what_does_not_fit_when_asked(tokenizer) -> None:
    """truncate_prompt=False / clip_max_new_tokens=False (what the HTTP server asks for): the
    window holds prompt + max_new_tokens; the defaults keep the posts' fitting."""
    strict = SamplingParams(max_new_tokens=2, truncate_prompt=False, clip_max_new_tokens=False)
    ids = list(range(10, 40))  # 30 tokens
    assert prepare_prompt(Request(prompt_token_ids=ids, params=strict), tokenizer, 32) == PreparedPrompt(ids, False)
    with pytest.raises(ContextLengthExceeded, match="^max_new_tokens is 2, more than the 1 tokens") as err:
        prepare_prompt(Request(prompt_token_ids=ids, params=strict), tokenizer, 31)
    assert err.value.field == "max_new_tokens"
    for window in (30, 8):  # no room left for one new token, or longer than the window
        with pytest.raises(ContextLengthExceeded, match=f"^prompt has 30 tokens.* at most {window - 1}$") as err:
            prepare_prompt(Request(prompt_token_ids=ids, params=strict), tokenizer, window)
        assert err.value.field == "prompt" and isinstance(err.value, ValueError)
    text = "one two three four five six seven eight nine ten " * 4
    with pytest.raises(ContextLengthExceeded, match="^prompt has"):  # text prompts count their tokens
        prepare_prompt(Request(prompt=text, params=strict), tokenizer, 5)
    prompt_only = SamplingParams(max_new_tokens=1000, truncate_prompt=False)  # a default max_tokens: clipped
    assert prepare_prompt(Request(prompt_token_ids=ids, params=prompt_only), tokenizer, 31) == PreparedPrompt(ids, False)
    # it survives pickling whole (an engine in its own process sends it over a pipe)
    again = pickle.loads(pickle.dumps(err.value))
    assert (type(again), again.field, again.detail, str(again)) == (type(err.value), "prompt", err.value.detail,
                                                                   str(err.value))
    with pytest.raises(ValueError, match="^clip_max_new_tokens must be a bool"):
        SamplingParams(clip_max_new_tokens=0).validate()


def test_prepare_prompt_rejects_ids_outside_vocab(tokenizer) -> None:
    vocab = len(tokenizer)
    prepare_prompt(Request(prompt_token_ids=[vocab - 1]), tokenizer, 16)
    with pytest.raises(ValueError, match="^prompt_token_ids "):
        prepare_prompt(Request(prompt_token_ids=[1, vocab]), tokenizer, 16)


def test_prepare_prompt_validates(tokenizer) -> None:
    with pytest.raises(ValueError, match="^prompt "):
        prepare_prompt(Request(prompt=""), tokenizer, 16)
    with pytest.raises(ValueError, match="^top_p "):
        prepare_prompt(Request(prompt="hi", params=SamplingParams(top_p=0)), tokenizer, 16)
    with pytest.raises(ValueError, match="^max_model_len "):
        prepare_prompt(Request(prompt="hi"), tokenizer, 0)


# ---------------------------------------------------------------- finish_reason_for


def test_finish_reason_for() -> None:
    p = SamplingParams(max_new_tokens=4)
    eos = (2, 7)
    assert finish_reason_for(7, 1, 10, p, eos, 100) == "stop"
    assert finish_reason_for(2, 4, 100, p, eos, 100) == "stop"  # EOS wins over length
    assert finish_reason_for(5, 3, 10, p, eos, 100) is None
    assert finish_reason_for(5, 4, 10, p, eos, 100) == "length"  # max_new_tokens reached
    assert finish_reason_for(5, 1, 100, p, eos, 100) == "length"  # context window full
    assert finish_reason_for(5, 1, 99, p, eos, 100) is None
    no_eos = SamplingParams(max_new_tokens=4, stop_on_eos=False)
    assert finish_reason_for(7, 1, 10, no_eos, eos, 100) is None
    assert finish_reason_for(7, 4, 10, no_eos, eos, 100) == "length"
    assert finish_reason_for(7, 1, 10, p, (), 100) is None
