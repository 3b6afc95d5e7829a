"""The yardstick: Hugging Face `generate` behind our engines' `generate(requests)` API.

It runs the way most people serve a model without an inference engine: static batches of
`max_batch_size` requests in arrival order, left padding, one `model.generate` call per batch,
a batch running until its longest member is done. It is our own weights in transformers'
model code (`loaded.path` is the same HF-format directory our loader read), so on a greedy
workload its tokens must equal ours: the bench checks that before it times anything.
"""
from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from common.requests import Completion, Request, prepare_prompt


class StepTimestamps(BaseStreamer):
    """Records when each decoding step's tokens reach the host (one `put` per step).

    `generate` first `put`s the prompt; that call is skipped. The `.cpu()` copy inside
    `generate` synchronises with the device, so these are real token-ready times.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFGenerateEngine:
    """`generate(requests) -> list[Completion]` on top of `transformers` `model.generate`."""

    def __init__(self, loaded, max_batch_size: int = 8) -> None:
        if max_batch_size <= 0:
            raise ValueError("max_batch_size: must be positive")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = int(loaded.config.max_position_embeddings)
        self.eos_token_ids = [int(t) for t in (loaded.config.eos_token_ids or ())]
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [int(self.tokenizer.eos_token_id)]
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a progress bar in the middle of a benchmark report is noise
        try:
            self.model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.model.to(loaded.device).eval()
        # generate() fills unset options from the model's own generation config; clear EOS there
        # so "no eos_token_id" really means "never stop early" (stop_on_eos=False).
        self.model.generation_config.eos_token_id = None
        self.device = loaded.device
        self._peak_kv_bytes = 0
        self._kv_bytes_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)

    def kv_stats(self) -> dict:
        """An estimate: HF's dynamic cache holds batch x (longest prompt + steps) tokens."""
        return {"peak_kv_bytes": self._peak_kv_bytes}

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        submitted = time.perf_counter()
        prepared = [prepare_prompt(r, self.tokenizer, self.max_model_len) for r in requests]  # validates all first
        out: list[Completion] = []
        for start in range(0, len(requests), self.max_batch_size):
            batch = list(range(start, min(start + self.max_batch_size, len(requests))))
            out += self._generate_batch([requests[i] for i in batch], [prepared[i] for i in batch], submitted)
        return out

    def _generate_batch(self, requests, prepared, submitted: float) -> list[Completion]:
        lengths = [len(p.token_ids) for p in prepared]
        longest = max(lengths)
        # Same cap as our engines: a row stops at max_new_tokens or when it fills the context.
        wants = [max(1, min(r.params.max_new_tokens, self.max_model_len - n)) for r, n in zip(requests, lengths)]
        steps = max(1, max(wants))
        input_ids = torch.full((len(requests), longest), self.pad_token_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros((len(requests), longest), dtype=torch.long)  # [B, P], 0 = left padding
        for row, p in enumerate(prepared):
            input_ids[row, longest - len(p.token_ids):] = torch.tensor(p.token_ids, dtype=torch.long)
            mask[row, longest - len(p.token_ids):] = 1
        params = requests[0].params
        sample = not all(r.params.greedy for r in requests)
        stop_early = all(r.params.stop_on_eos for r in requests) and bool(self.eos_token_ids)
        options = dict(max_new_tokens=steps, do_sample=sample, num_beams=1, pad_token_id=self.pad_token_id)
        if stop_early:
            options["eos_token_id"] = self.eos_token_ids
        if sample:
            options.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        streamer = StepTimestamps()
        scheduled = time.perf_counter()
        sequences = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                        streamer=streamer, **options)  # [B, P + steps_run]
        new_tokens = sequences[:, longest:].tolist()
        self._peak_kv_bytes = max(self._peak_kv_bytes,
                                  len(requests) * (longest + len(new_tokens[0])) * self._kv_bytes_per_token)
        return [self._completion(r, p, ids[:want], streamer.times, submitted, scheduled)
                for r, p, ids, want in zip(requests, prepared, new_tokens, wants)]

    def _completion(self, request: Request, prepared, ids: list[int], times: list[float],
                    submitted: float, scheduled: float) -> Completion:
        finish = "length"
        if request.params.stop_on_eos:
            for n, tid in enumerate(ids):
                if tid in self.eos_token_ids:
                    ids, finish = ids[: n + 1], "stop"  # the EOS token is part of the output, as in HF
                    break
        stamps = times[: len(ids)]
        timings = {"submitted": submitted, "scheduled": scheduled}
        if stamps:
            timings.update(first_token=stamps[0], finished=stamps[-1])
        return Completion(
            prompt_token_ids=list(prepared.token_ids), token_ids=list(ids),
            text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
            token_timestamps=stamps, truncated=prepared.truncated, timings=timings, prompt=request.prompt,
        )
