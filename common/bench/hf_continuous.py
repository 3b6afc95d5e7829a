"""The second yardstick: transformers' own continuous batching behind our `generate(requests)` API.

Recent transformers versions ship a paged-KV continuous-batching engine: `model.generate_batch`
and the manager it runs on (`continuous_batching_context_manager`). It is the fair comparison
for stages 04+: the same idea, written by the transformers team. We drive the manager exactly
as `generate_batch` does -- open a manager, add every request, collect the results, close it --
with two differences that keep the comparison like for like:

* each request keeps its own `max_new_tokens` and EOS behaviour (`generate_batch` takes one
  `max_new_tokens` for the whole list, which the mixed-output workload cannot use);
* the KV pool is sized to the workload (`num_blocks`, `page_size`), not "90% of free memory",
  which on a CPU means gigabytes of RAM zeroed per call; and the manager's set-up (its cache
  allocation and warm-up) happens before `submitted` is stamped, as our engines' pools are
  allocated in their constructors. The set-up time is kept in `setup_s`.

A fresh manager per `generate` call means a fresh prefix cache per run, as for our engines.
"""
from __future__ import annotations

import inspect
import time

from common.requests import Completion, Request, prepare_prompt
from common.threads import release_caller_openmp_threads


def available(loaded) -> tuple[bool, str]:
    """Whether this transformers has continuous batching (`generate_batch`), and if not, why."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM  # noqa: F401
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError as exc:
        return False, f"transformers has no continuous batching API ({exc})"
    try:
        from transformers import LlamaForCausalLM
    except ImportError:  # pragma: no cover
        return False, "transformers: cannot import a causal LM class"
    if not hasattr(LlamaForCausalLM, "generate_batch"):
        return False, f"transformers {transformers.__version__} has no generate_batch"
    return True, ""


class HFContinuousEngine:
    """`generate(requests) -> list[Completion]` on transformers' continuous batching manager."""

    def __init__(self, loaded, max_batch_size: int = 8, num_blocks: int = 256, block_size: int = 16,
                 max_batch_tokens: int | None = None, timeout_s: float = 600.0) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.utils import logging as hf_logging

        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = int(loaded.config.max_position_embeddings)
        self.eos_token_ids = [int(t) for t in (loaded.config.eos_token_ids or ())]
        self.timeout_s = timeout_s
        hf_logging.disable_progress_bar()
        # Its own copy of the weights: the manager may switch the model's attention implementation.
        self.model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype).to(loaded.device).eval()
        if not hasattr(self.model, "generate_batch"):
            raise RuntimeError("this transformers has no generate_batch (continuous batching)")
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)
        # The block size's keyword: `page_size` in recent releases, `block_size` in older ones (5.17,
        # which the GPU machines' image has, refuses `page_size`).
        size_kw = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=int(num_blocks), max_requests_per_batch=int(max_batch_size),
            max_batch_tokens=int(max_batch_tokens or max(256, 64 * max_batch_size)), **{size_kw: int(block_size)})
        self.setup_s: list[float] = []
        self._kv_pool_bytes = int(num_blocks) * int(block_size) * loaded.config.kv_bytes_per_token(loaded.dtype)

    def kv_stats(self) -> dict:
        """transformers does not report how much of its pool was used: only the pool size is known."""
        return {"peak_kv_bytes": None, "pool_kv_bytes": self._kv_pool_bytes}

    def generate(self, requests: list[Request]) -> list[Completion]:
        # No torch.inference_mode() here: the manager's warm-up (this thread) creates tensors that
        # its generation thread later updates in place, which inference tensors forbid.
        prepared = [prepare_prompt(r, self.tokenizer, self.max_model_len) for r in requests]  # validates all first
        if not all(r.params.greedy for r in requests):
            raise ValueError("params: HFContinuousEngine runs greedy workloads only")
        t_setup = time.perf_counter()
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation_config, continuous_batching_config=self.cb_config,
                block=True, timeout=10, warmup=True) as manager:
            # Its warm-up ran the model on this thread; its generation thread runs it from now
            # on. The same hand-over as our SchedulerManager's (common/threads.py), so both
            # engines' worker threads get the CPU's OpenMP threads on equal terms.
            release_caller_openmp_threads()
            submitted = time.perf_counter()
            self.setup_s.append(submitted - t_setup)
            ids: list[str] = []
            for i, (r, p) in enumerate(zip(requests, prepared)):
                # Same cap as our engines: stop at max_new_tokens or when the context is full.
                want = max(1, min(r.params.max_new_tokens, self.max_model_len - len(p.token_ids)))
                eos = self.eos_token_ids if (r.params.stop_on_eos and self.eos_token_ids) else -1
                rid = manager.add_request(list(p.token_ids), request_id=f"r{i}", max_new_tokens=want,
                                          record_timestamps=True, eos_token_id=eos)
                if rid is None:
                    raise RuntimeError(f"transformers continuous batching refused request {i}")
                ids.append(rid)
            results = self._collect(manager, set(ids))
        return [self._completion(r, p, results[rid], submitted) for r, p, rid in zip(requests, prepared, ids)]

    def _collect(self, manager, wanted: set[str]) -> dict:
        results: dict = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < len(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers continuous batching: {len(wanted) - len(results)} requests "
                                   f"unfinished after {self.timeout_s:.0f} s")
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching: the generation thread stopped")
                continue
            if out.request_id in wanted and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers continuous batching: {out.request_id}: {out.error}")
                results[out.request_id] = out
        return results

    def _completion(self, request: Request, prepared, out, submitted: float) -> Completion:
        ids = list(out.generated_tokens)
        stamps = list(out.timestamps or [])[: len(ids)]
        finish = "stop" if (request.params.stop_on_eos and ids and ids[-1] in self.eos_token_ids) else "length"
        timings = {"submitted": submitted}
        if stamps:
            timings.update(first_token=stamps[0], finished=stamps[-1])
        return Completion(
            prompt_token_ids=list(prepared.token_ids), token_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
            token_timestamps=stamps, truncated=prepared.truncated, timings=timings, prompt=request.prompt,
        )
