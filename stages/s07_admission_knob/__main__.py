"""Generate text with this stage: `python -m stages.<stage> "prompt" [--max-new-tokens N ...]`."""

from __future__ import annotations

import argparse
import importlib
import sys

from common.commands import add_model_args, add_sampling_args, run_command, sampling_knobs
from common.loader import load_model
from common.requests import Request, SamplingParams
from common.tokenizer import chat_prompt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="one or more prompts (batched together)")
    add_model_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=8)
    add_sampling_args(parser)
    parser.add_argument("--no-stop-on-eos", dest="stop_on_eos", action="store_false")
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="send the raw prompt, no chat template")
    args = parser.parse_args(argv)
    # Bad flags are refused here, before any weights load.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_on_eos=args.stop_on_eos, **sampling_knobs(args))
    params.validate()

    stage = importlib.import_module(__package__)  # this stage's package, not another one
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = stage.InferenceEngine(loaded, max_batch_size=args.max_batch_size)
    texts = [chat_prompt(loaded.tokenizer, p) if args.chat else p for p in args.prompts]
    for prompt, completion in zip(args.prompts, engine.generate([Request(prompt=t, params=params) for t in texts])):
        print(f"### {prompt}")
        print(completion.text)
        print()


if __name__ == "__main__":
    sys.exit(run_command(main, f"python -m {__package__}"))  # bad input: one line naming the field
