"""stagewise.common — everything that never changes between stages.

The model, the tokenizer helpers, sampling, the request types, metrics and the
benchmark harness. Stages import from here; nothing here imports a stage except
`common.stages`, which loads them by name for benchmarks that compare two stages.

Names are re-exported lazily (PEP 562) so that `import common` stays cheap and a
script that only needs metrics does not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ModelConfig": "common.config",
    "DecoderModel": "common.model",
    "Attention": "common.model",
    "LoadedModel": "common.loader",
    "load_model": "common.loader",
    "SamplingParams": "common.requests",
    "Request": "common.requests",
    "Completion": "common.requests",
    "PreparedPrompt": "common.requests",
    "prepare_prompt": "common.requests",
    "finish_reason_for": "common.requests",
    "make_generator": "common.sampling",
    "sample_tokens": "common.sampling",
    "encode": "common.tokenizer",
    "chat_prompt": "common.tokenizer",
    "IncrementalDetokenizer": "common.tokenizer",
    "percentiles": "common.metrics",
    "summarize": "common.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'common' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
