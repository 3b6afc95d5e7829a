"""InferenceEngine for stage 01: static batches, full recompute every step.

The simplest engine that is still a batching engine. It is slow on purpose — each new
token costs a forward pass over the whole sequence — and every later stage is this file
plus one idea, so read it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.device import to_device
from common.loader import LoadedModel
from common.requests import Completion, Request, SamplingParams, finish_reason_for, int_knob, prepare_prompt
from common.sampling import make_generator, sample_tokens

from .attention import DenseAttention, causal_padding_mask


@dataclass
class _Row:
    """One request's state inside a static batch."""

    request: Request
    prompt_ids: list[int]
    truncated: bool
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into one rectangle, so every row's last token sits in the last column.

    Returns ids [B, T] and valid [B, T] (False on padding).
    """
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    valid = torch.zeros((len(seqs), T), dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, T - len(s):] = torch.tensor(s, dtype=torch.long)
        valid[b, T - len(s):] = True
    return ids.to(device), valid.to(device)


class InferenceEngine:
    """Generates completions for a list of requests, `max_batch_size` at a time."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 8) -> None:
        int_knob("max_batch_size", max_batch_size, 1)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = loaded.config.max_position_embeddings
        self.eos_token_ids = loaded.config.eos_token_ids
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or (0,))[0])
        self._peak_kv_bytes = 0

    def kv_stats(self) -> dict:
        """KV memory this engine held at its peak (stage 01 keeps no KV cache at all)."""
        return {"peak_kv_bytes": self._peak_kv_bytes}

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run every request to completion; the result is in the order of `requests`."""
        submitted = time.perf_counter()
        # Validate and tokenize everything first: bad input fails before any work is done.
        prepared = [prepare_prompt(r, self.tokenizer, self.max_model_len) for r in requests]
        completions: list[Completion] = []
        for start in range(0, len(requests), self.max_batch_size):
            rows = [
                _Row(r, p.token_ids, p.truncated, make_generator(r.params, self.device))
                for r, p in zip(requests[start:start + self.max_batch_size], prepared[start:start + self.max_batch_size])
            ]
            scheduled = time.perf_counter()
            self._run_batch(rows)
            completions.extend(self._completion(row, submitted, scheduled) for row in rows)
        return completions

    def _run_batch(self, rows: list[_Row]) -> None:
        """Full recompute: each step runs the model over every token generated so far."""
        ids, valid = left_pad([r.prompt_ids for r in rows], self.pad_token_id, self.device)  # [B, T]
        last = torch.full((len(rows),), ids.shape[1] - 1, dtype=torch.long, device=self.device)  # [B]
        while True:
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
            attention = DenseAttention(causal_padding_mask(valid), self.loaded.dtype)
            logits = self.model(ids, positions, attention, logits_indices=last)  # [B, V]
            next_ids, alive = self._sample_and_record(rows, logits)  # [B], [B]
            if all(r.finished for r in rows):  # from the host: alive.any() would wait for the device
                return
            # Finished rows still take a (masked) column: in a static batch they wait for the rest.
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
            valid = torch.cat([valid, alive[:, None]], dim=1)
            last = last + 1

    def _sample_and_record(self, rows: list[_Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token for every unfinished row, record it, and decide who is done.

        logits: [B, V]. Returns the next input ids [B] (padding for finished rows) and
        alive [B]: True for rows that still need another step.
        """
        live = [b for b, r in enumerate(rows) if not r.finished]
        scores = logits if len(live) == len(rows) else logits[live]  # all live: no copy of the [B, V] logits
        tokens = sample_tokens(scores, [rows[b].params for b in live], [rows[b].generator for b in live])
        now = time.perf_counter()
        next_ids = [self.pad_token_id] * len(rows)
        for b, tok in zip(live, tokens):
            row = rows[b]
            row.generated.append(tok)
            row.timestamps.append(now)
            row.finish_reason = finish_reason_for(
                tok, len(row.generated), len(row.prompt_ids) + len(row.generated),
                row.params, self.eos_token_ids, self.max_model_len,
            )
            next_ids[b] = tok
        alive = to_device([not r.finished for r in rows], torch.bool, self.device)
        return to_device(next_ids, torch.long, self.device), alive

    def _completion(self, row: _Row, submitted: float, scheduled: float) -> Completion:
        ts = row.timestamps
        return Completion(
            prompt_token_ids=row.prompt_ids,
            token_ids=row.generated,
            text=self.tokenizer.decode(row.generated, skip_special_tokens=True),
            finish_reason=row.finish_reason or "length",
            token_timestamps=ts,
            truncated=row.truncated,
            timings={"submitted": submitted, "scheduled": scheduled, "first_token": ts[0], "finished": ts[-1]},
            prompt=row.request.prompt,
        )
