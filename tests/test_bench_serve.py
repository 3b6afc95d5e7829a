"""`stagewise bench-serve` and `serve-overhead` without a live server: bench-serve's HTTP reading
(common/serve/sse_client.py: chunked framing parsed from whatever a read returns, a head in one read),
its event loop and flags, and serve-overhead's flags, figures and one paired run on `tiny`.
The tests that need a running server (a report over HTTP, a server's error) are in test_serve.py."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.serve.sse_client import Connection, split_chunks

REPO = Path(__file__).resolve().parents[1]

EVENTS = [b'data: {"text": "Hi"}\n\n', b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]


def chunked(parts: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailers + b"\r\n"


@pytest.mark.parametrize("trailers", [b"", b"x-usage: 1\r\n"])
def test_split_chunks_reassembles_any_split_of_the_stream(trailers: bytes) -> None:
    wire = chunked(EVENTS, trailers)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(1, 12)))
        got, buf, done = [], b"", False
        for a, b in zip([0] + cuts, cuts + [len(wire)]):
            assert not done  # nothing is announced finished before its last byte
            pieces, buf, done = split_chunks(buf + wire[a:b])
            got += pieces
        assert done and buf.endswith(b"\r\n") and b"".join(got) == b"".join(EVENTS)


def test_head_and_chunked_body_from_a_stream_reader() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> tuple[int, dict, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(head + chunked(EVENTS))
        conn = Connection(reader, writer=None)  # type: ignore[arg-type]
        status, headers = await conn.response_head()
        body = b"".join([p async for p in conn.body_pieces(headers)])
        return status, headers, body

    status, headers, body = asyncio.run(main())
    assert status == 200 and headers["transfer-encoding"] == "chunked" and body == b"".join(EVENTS)


def test_a_closed_connection_is_a_connection_error() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_eof()
        await Connection(reader, writer=None).response_head()  # type: ignore[arg-type]

    with pytest.raises(ConnectionError):
        asyncio.run(main())


# ----------------------------------------------------------------------------- bench-serve's loop and flags

def test_bench_serve_runs_on_uvloop_where_installed(monkeypatch) -> None:
    """`--loop auto` takes uvloop when it is there and asyncio's loop when it is not, and says which."""
    import argparse
    import importlib.util

    from common.serve import bench as bench_serve

    async def loop_class() -> str:
        return type(asyncio.get_running_loop()).__module__

    args = argparse.Namespace(loop="auto")
    assert bench_serve.run_event_loop(loop_class(), args).startswith("uvloop") and args.loop == "uvloop"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    args = argparse.Namespace(loop="auto")
    assert bench_serve.run_event_loop(loop_class(), args).startswith("asyncio") and args.loop == "asyncio"



def test_bench_serve_workload_flags_match_the_benches() -> None:
    from common.bench import flags
    from common.serve import bench as bench_serve
    ours = {a.dest: a.default for a in bench_serve.build_parser()._actions}
    theirs = {a.dest: a.default for a in flags.build_parser("bench")._actions}
    for flag, _ in bench_serve.WORKLOAD_FLAGS:
        dest = flag.lstrip("-").replace("-", "_")
        assert ours[dest] == theirs[dest], flag


def test_bench_serve_says_chat_questions_go_to_completions_as_plain_text() -> None:
    """The benches wrap each question in the chat template; bench-serve sends /v1/completions the
    bare question (the server applies no template there), and its header says so."""
    from common.serve import bench as bench_serve
    for endpoint, plain in (("completions", True), ("chat", False)):
        args = bench_serve.build_parser().parse_args(["--base-url", "http://127.0.0.1:9", "--model", "tiny",
                                                      "--chat-prompts", "--endpoint", endpoint])
        workload = bench_serve.header(args, bench_serve.Target(args.base_url, endpoint, None))["Workload"]
        assert workload.startswith("a different short chat question each")
        assert ("as plain text: /v1/completions applies no chat template" in workload) is plain



# ----------------------------------------------------------------------------- serve-overhead

def test_serve_overhead_sides_take_the_same_flags() -> None:
    """Both sides run one workload (bench's and bench-serve's parsers read the same flags) on the
    server's manager, built from the knobs `stagewise serve` takes."""
    import argparse

    from common.bench import flags
    from common.serve import bench as bench_serve, engine as serve_engine, overhead as serve_overhead
    a = serve_overhead.build_parser().parse_args(["--model", "tiny", "--dtype", "float32"])
    workload, knobs = serve_overhead._workload_flags(a), serve_overhead._engine_flags(a)
    local = flags.build_parser("bench").parse_args(workload)
    remote = bench_serve.build_parser().parse_args(["--base-url", "http://127.0.0.1:1", *workload])
    server = argparse.ArgumentParser()
    serve_engine.add_serve_args(server)
    served = server.parse_args(knobs + ["--model", "tiny"])
    for name in ("num_requests", "max_new_tokens", "prompt", "unique_prompts", "no_stop_on_eos", "seed"):
        assert getattr(local, name) == getattr(remote, name), name
    assert served.no_prefix_cache and served.stream_interval == 1 and served.dtype == "float32"
    assert served.max_batch_size == served.prefill_max_batch_size == a.num_requests  # one burst, one prefill
    assert served.max_queue_delay_ms == 200.0 and served.queue_quiet_ms == 50.0  # an idle worker waits for the whole burst
    assert not local.pretok
    # At a rate (post 052's 50/s), requests are admitted as they come, as `stagewise serve` does.
    paced = serve_overhead.build_parser().parse_args(["--model", "tiny", "--request-rate", "50"])
    served = server.parse_args(serve_overhead._engine_flags(paced) + ["--model", "tiny"])
    assert served.max_queue_delay_ms == 0.0 and served.queue_quiet_ms == 5.0  # no wait: its window not passed
    for bad in ("0", "-5", "nan"):
        with pytest.raises(ValueError, match="--request-rate"):
            serve_overhead.main(["--model", "tiny", "--request-rate", bad])



def test_serve_overhead_figures() -> None:
    from types import SimpleNamespace

    from common.serve.overhead import intake_span_ms, overhead, pair
    burst = [SimpleNamespace(timings={"submitted": t}) for t in (2.0015, 2.0, 2.0105)]
    assert intake_span_ms(burst) == pytest.approx(10.5)
    http = {"throughput_tok_s": {"completion": 90.0}, "ttft_ms": {"p50": 14.0}}
    local = {"throughput_tok_s": {"completion": 100.0}, "ttft_ms": {"p50": 10.0}}
    got = overhead(http, local)
    assert got["throughput_loss_pct"] == pytest.approx(10.0) and got["ttft_p50_added_ms"] == pytest.approx(4.0)
    assert got["within_targets"]
    assert not overhead({**http, "ttft_ms": {"p50": 16.0}}, local)["within_targets"]
    # Like for like: where the in-process consumer got its first token, when the run has that stamp.
    received = overhead(http, {**local, "ttft_received_ms": {"p50": 12.0}})
    assert received["ttft_p50_added_ms"] == pytest.approx(2.0)
    assert received["ttft_p50_ms"] == {"http": 14.0, "in_process": 12.0, "in_process_sampled": 10.0}
    # A pair is judged net of each run's own prefill: here HTTP's prefill ran 100 ms slower.
    http_run = {"throughput_tok_s": {"completion": 95.0}, "ttft_ms": {"p50": 620.0}}
    local_run = {"throughput_tok_s": {"completion": 100.0}, "ttft_ms": {"p50": 510.0},
                 "ttft_received_ms": {"p50": 512.0}, "prefill_to_first_token_ms": {"p50": 500.0},
                 "queue_wait_ms": {"p50": 6.0}, "intake_span_ms": 5.0}
    http_engine = {"prefill_to_first_token_ms": {"p50": 600.0}, "queue_wait_ms": {"p50": 9.0}, "intake_span_ms": 12.0}
    p = pair(http_run, http_engine, local_run, "http")
    assert p["intake_span_ms"] == {"http": 12.0, "in_process": 5.0}
    assert p["ttft_p50_added_ms"] == pytest.approx(8.0) and p["ttft_p50_added_raw_ms"] == pytest.approx(108.0)
    assert p["throughput_loss_pct"] == pytest.approx(5.0)
    pairs = [p, {**p, "ttft_p50_added_ms": 2.0, "throughput_loss_pct": 1.0},
             {**p, "ttft_p50_added_ms": 3.0, "throughput_loss_pct": 20.0}]
    both = overhead(http_run, local_run, pairs)
    assert both["ttft_p50_added_ms"] == pytest.approx(3.0) and both["throughput_loss_pct"] == pytest.approx(5.0)
    assert both["within_targets"] and both["pairs"] == pairs
    # At a rate only throughput is judged: a request's wait for the step in flight swamps 5 ms.
    slow_first = overhead({**http, "ttft_ms": {"p50": 300.0}}, local, burst=False)
    assert slow_first["within_targets"] and "ttft_p50_added_ms" not in slow_first["targets"]
    assert not overhead({**http, "throughput_tok_s": {"completion": 80.0}}, local, burst=False)["within_targets"]



@pytest.mark.parametrize("where,rate", [("--engine-process", ["--request-rate", "200"]), ("--no-engine-process", [])])
def test_serve_overhead_runs_paired_on_tiny(tmp_path: Path, where: str, rate: list[str]) -> None:
    """End to end: the server thread, the engine in its own process or beside it, bench-serve
    stepping through stdin, a burst or requests at a rate on both sides, the JSON."""
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "common.cli", "serve-overhead", "--model", "tiny", "--device", "cpu",
                           "--dtype", "float32", "--num-requests", "4", "--max-batch-size", "4",
                           "--prefill-max-batch-size", "4", "--max-new-tokens", "3", "--warmup-runs", "1",
                           "--repeat-runs", "2", where, *rate, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    figures = result["overhead"]
    assert [p["first"] for p in figures["pairs"]] == ["in-process", "http"]
    assert len(result["runs"]) == 2 and len(result["compare"][0]["runs"]) == 2
    for p in figures["pairs"]:
        assert p["prefill_p50_ms"]["http"] > 0 and p["prefill_p50_ms"]["in_process"] > 0
        assert p["intake_span_ms"]["http"] > 0 and p["intake_span_ms"]["in_process"] > 0  # 4 requests, 4 stamps
        assert p["loop_cpu_us_per_request"] > 0 and p["loop_cpu_us_per_token"] > 0  # the event loop did the HTTP
    assert figures["loop_cpu_us_per_request"] > 0
    assert result["completion_tokens"] == 4 * 3 and result["compare"][0]["completion_tokens"] == 4 * 3
    assert result["env"]["git_commit"] and result["dtype"] == "float32" and result["dtype_reason"] == "asked: float32"
    assert result["engine_process"] is (where == "--engine-process") and result["config"]["engine_process"] is result["engine_process"]
    if rate:  # both sides sent one request every 5 ms, on a fixed schedule: 3 gaps, 15 ms from first to last
        http_config = result["bench_serve_config"]
        assert http_config["request_rate"] == 200.0 and http_config["arrivals"] == "fixed"
        assert all(r["submit_interval_ms"] == 5.0 and r["submit_schedule"] == "absolute"
                   for r in result["compare"][0]["runs"])
        for p in figures["pairs"]:  # spread out, not a burst (4 requests in a few ms); the first one, on a
            # fresh connection, may reach the server a ms or two late (13.8 ms was seen on a 2-core CI machine)
            assert p["intake_span_ms"]["http"] >= 10.0 and p["intake_span_ms"]["in_process"] >= 10.0
        assert result["config"]["max_queue_delay_ms"] == 0.0 and "ttft_p50_added_ms" not in figures["targets"]
    else:
        assert result["bench_serve_config"]["request_rate"] == float("inf")
        assert result["config"]["max_queue_delay_ms"] == 200.0

