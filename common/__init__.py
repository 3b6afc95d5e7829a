"""stagewise.common — everything that never changes between stages.

The engine's parts at its root (the model, the loader, the tokenizer helpers, sampling,
the request types), the measuring kit in `common.bench` and the HTTP layer in
`common.serve`. Stages import from here; nothing here imports a stage except
`common.stages`, which loads them by name for benchmarks that compare two stages.

The root's public names are re-exported lazily (PEP 562) so that `import common` stays
cheap and a script that only needs the request types does not pay for importing transformers.
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
