"""The posts' streaming benchmark (stages 04+): requests arrive over time while others decode.

One submitter thread calls `SchedulerManager.add_request` on a schedule (`--submit-interval-ms`,
`absolute`: request i at t0 + i * interval, however long earlier calls took; `relative`: sleep
the interval after each call returns) and one consumer thread per request drains its stream,
so streaming itself is exercised, as a client would. A request with a planned arrival
(`Request.submit_offset_s`, e.g. --long-prompts' late ones) is submitted at t0 + that offset
instead, taking no slot of the schedule; submissions go in order of planned time. The manager stamps each Completion
(submitted / tokenized / scheduled / first_token / finished and per-token times); this file
adds what only the client sees: submit lag, add_request latency and submit wall.
A fresh SchedulerManager is made for every run and always closed.
"""
from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from typing import Any, Callable

from common.bench.engines import EngineSpec, dtype_line, knob_header, run_engines
from common.bench.flags import describe_workload
from common.bench.knobs import accepted, manager_knobs
from common.bench.metrics import percentiles, summarize


def _sleep_until(deadline: float) -> None:
    """Sleep, then yield-spin the last half millisecond: time.sleep alone overshoots."""
    remaining = deadline - time.perf_counter()
    if remaining > 5e-4:
        time.sleep(remaining - 5e-4)
    while time.perf_counter() < deadline:
        time.sleep(0)


def _submit_kwargs(request) -> dict:
    """Ids whenever the workload has them (--pretok, random-length prompts), with the text
    alongside (post 004 needs "different text, same ids"); else text only, so the manager tokenizes."""
    kwargs = {"prompt": request.prompt, "params": request.params}
    if request.prompt_token_ids is not None:
        kwargs["prompt_token_ids"] = request.prompt_token_ids
    return kwargs


def run_streaming_once(manager: Any, requests: list, *, submit_interval_ms: float = 0.0,
                       submit_schedule: str = "absolute", timeout_s: float = 600.0,
                       clock: Callable[[], float] = time.perf_counter,
                       sleep_until: Callable[[float], None] = _sleep_until) -> tuple[dict, list]:
    """Submit `requests` to `manager` on the schedule, drain every stream, summarize the run.

    `clock` stamps the client's times (must be the clock the manager stamps Completions with) and
    `sleep_until(deadline)` waits for a time on it: a test passes a virtual clock, so it can check
    the schedule exactly, where the wall clock of a busy machine would only bound it.
    """
    if submit_schedule not in ("absolute", "relative"):
        raise ValueError(f"submit_schedule: 'absolute' or 'relative', got {submit_schedule!r}")
    n, interval = len(requests), submit_interval_ms / 1000.0
    planned, called, returned = [0.0] * n, [0.0] * n, [0.0] * n
    completions: list[Any] = [None] * n
    streamed: list[tuple[str, list[int]]] = [("", [])] * n
    received: list[float | None] = [None] * n  # when the consumer got the first token (not when it was sampled)
    errors: list[tuple[int, BaseException]] = []
    inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]

    def consume(i: int) -> None:
        handle = inboxes[i].get()
        if handle is None:  # submission failed
            return
        try:
            text, ids = [], []
            for chunk in handle:
                if received[i] is None and chunk.token_ids:
                    received[i] = clock()
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
            streamed[i] = ("".join(text), ids)
            completions[i] = handle.result(timeout=timeout_s)
        except BaseException as exc:  # the request's own error: report it, keep the others going
            errors.append((i, exc))

    # Requests on the schedule in list order; requests with a planned arrival by that time.
    plain = [i for i, r in enumerate(requests) if r.submit_offset_s is None]
    timed = sorted((i for i, r in enumerate(requests) if r.submit_offset_s is not None),
                   key=lambda i: requests[i].submit_offset_s)

    def submit() -> None:
        t0 = clock()
        next_at = t0
        k = j = 0  # plain[k] is the next request on the schedule (it takes slot k), timed[j] the next late one
        while k < len(plain) or j < len(timed):
            slot_at = None if k == len(plain) else (t0 + k * interval if submit_schedule == "absolute" else next_at)
            late = j < len(timed) and (slot_at is None or t0 + requests[timed[j]].submit_offset_s < slot_at)
            if late:
                i, j = timed[j], j + 1
                planned[i] = t0 + requests[i].submit_offset_s
            else:
                i, k = plain[k], k + 1
                planned[i] = slot_at
            sleep_until(planned[i])
            called[i] = clock()
            try:
                handle = manager.add_request(**_submit_kwargs(requests[i]))
            except BaseException as exc:
                errors.append((i, exc))
                handle = None
            returned[i] = clock()
            inboxes[i].put(handle)
            if not late:
                next_at = returned[i] + interval

    consumers = [threading.Thread(target=consume, args=(i,), daemon=True, name=f"consumer-{i}") for i in range(n)]
    for t in consumers:
        t.start()
    submitter = threading.Thread(target=submit, daemon=True, name="submitter")
    submitter.start()
    deadline = time.perf_counter() + timeout_s
    for t in [submitter, *consumers]:
        t.join(max(0.0, deadline - time.perf_counter()))
    stuck = [i for i, t in enumerate(consumers) if t.is_alive()]
    if submitter.is_alive() or stuck:
        raise RuntimeError(f"streaming run timed out after {timeout_s:.0f} s; unfinished requests: {stuck[:10]}")
    if errors:
        i, exc = sorted(errors, key=lambda e: e[0])[0]
        raise RuntimeError(f"{len(errors)} of {n} requests failed; first: request {i}: {exc!r}") from exc

    _check_stamps_and_streams(completions, streamed, called, returned)
    starts = [c.timings["submitted"] for c in completions]
    ends = [c.token_timestamps[-1] if c.token_timestamps else c.timings.get("finished", starts[0])
            for c in completions]
    summary = summarize(completions, wall_s=max(1e-9, max(ends) - min(starts)))
    summary.update(
        submit_wall_s=max(called) - min(called),
        submit_interval_ms=float(submit_interval_ms),
        submit_schedule=submit_schedule,
        submit_lag_ms=percentiles((c - p) * 1000.0 for c, p in zip(called, planned)),
        add_request_ms=percentiles((r - c) * 1000.0 for c, r in zip(called, returned)),
    )
    # TTFT as a client sees it: submit -> the consumer thread holding the first token, after the
    # worker's queue and a thread switch (ttft_ms is stamped where the token is sampled). This is
    # the in-process twin of what an HTTP client measures, which is what serve-overhead compares.
    got = [(r - c.timings["submitted"]) * 1000.0 for r, c in zip(received, completions) if r is not None]
    if got:
        summary["ttft_received_ms"] = percentiles(got)
    if timed:
        # The streams the late arrivals land among, on their own: their ITL is what a long
        # prefill stalls (stage 11's number). The pooled itl_ms above counts the late ones too.
        summary["late_requests"] = len(timed)
        summary["on_schedule_itl_ms"] = summarize([completions[i] for i in plain])["itl_ms"] if plain else {}
    return summary, completions


def _check_stamps_and_streams(completions: list, streamed: list, called: list, returned: list) -> None:
    """TTFT is only honest if "submitted" is the add_request call; streams must add up to results."""
    late = 0
    for i, c in enumerate(completions):
        submitted = c.timings.setdefault("submitted", called[i])
        if not called[i] <= submitted <= returned[i]:
            late += 1
    if late:
        print(f"WARNING: {late} completions have timings['submitted'] outside their add_request call; "
              f"TTFT/latency are measured from the manager's stamp", file=sys.stderr, flush=True)
    bad = [i for i, (c, (text, ids)) in enumerate(zip(completions, streamed)) if text != c.text or ids != c.token_ids]
    if bad:
        print(f"WARNING: streamed text/ids differ from the final result for requests {bad[:10]}",
              file=sys.stderr, flush=True)


def make_manager(spec: EngineSpec, args: argparse.Namespace) -> Any:
    cls = spec.module.SchedulerManager
    return cls(spec.engine, **accepted(cls, {**manager_knobs(args), "record_token_timestamps": True}))


def run_streaming_engines(specs: list[EngineSpec], requests: list, args: argparse.Namespace,
                          after_run: Callable[[], None] | None = None) -> dict:
    """Warmups and alternating repeats (common.bench.engines.run_engines), each run on a new manager."""

    def run_once(spec: EngineSpec) -> tuple[dict, list]:
        manager = make_manager(spec, args)
        try:
            return run_streaming_once(manager, requests, submit_interval_ms=args.submit_interval_ms,
                                      submit_schedule=args.submit_schedule, timeout_s=args.request_timeout_s)
        finally:
            manager.close()

    return run_engines(specs, run_once, requests, args.warmup_runs, args.repeat_runs, args.fresh_engine, after_run)


def streaming_header(args: argparse.Namespace, loaded, spec: EngineSpec) -> dict:
    manager_takes_prefill = accepted(spec.module.SchedulerManager, {"prefill_max_batch_size": 0})
    header = {"Model": loaded.name, "Device": str(loaded.device), "Dtype": dtype_line(loaded),
              "Engine": spec.name, "Mode": "streaming (SchedulerManager)", "Workload": describe_workload(args),
              "Pretok": args.pretok or args.prompt_len_min is not None or bool(args.shared_prefix_len),
              "Pretok base token ids": True if args.pretok_base_token_ids else None,
              "Tokenize workers": args.tokenize_workers, "Stream interval": args.stream_interval,
              "Max batch size": args.max_batch_size}
    if manager_takes_prefill:
        header["Prefill max batch size"] = args.prefill_max_batch_size or args.max_batch_size
    if args.max_queue_delay_ms and accepted(spec.module.SchedulerManager, {"max_queue_delay_ms": 0}):
        header["Max queue delay"] = f"{args.max_queue_delay_ms:g} ms (quiet {args.queue_quiet_ms:g} ms)"
    header.update(knob_header(spec, str(loaded.device)))
    header["Repeats"] = f"{args.repeat_runs} (+{args.warmup_runs} warmup), medians"
    return header
