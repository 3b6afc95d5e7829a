"""`stagewise serve`'s app and uvicorn server in a thread of the test process, over a given state.

Shared by tests/test_serve.py and tests/test_serve_context.py (LiveServer: stage 09's manager
built in the test process) and tests/test_engine_process.py (the engine in a process of its own),
with the helpers they use (`scrape`: /metrics read and its format checked, for
tests/test_serve_metrics.py and test_engine_process.py).
"""
from __future__ import annotations

import re
import signal
import threading
import time

from typing import Any, Callable

import httpx
import openai

from common import stages as registry
from common.serve.transport import bind_socket
from common.serve.app import ServeState
from common.serve.server import make_server


class ServerThread:
    """The server on 127.0.0.1 (a free port) in a thread; stop() takes the SIGTERM path."""

    def __init__(self, state: ServeState) -> None:
        self.state = state
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = make_server(self.state, sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def blocks_in_use(self) -> int:
        kv = self.state.check_health().result(30)
        return kv["total"] - kv["free"]

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"


class LiveServer(ServerThread):
    """Stage 09's manager, built in this process, behind `stagewise serve`'s app in a thread."""

    def __init__(self, loaded: Any, slow_s: float = 0.0, max_batch_size: int = 8, **knobs: Any) -> None:
        stage = registry.load_stage(9)
        engine = stage.InferenceEngine(loaded, max_batch_size=max_batch_size, prefix_cache_max_entries=0, **knobs)
        manager = stage.SchedulerManager(engine, max_batch_size=max_batch_size)
        if slow_s:  # requests stay in flight long enough to drop or stop them
            slow_down(manager, slow_s)
        super().__init__(ServeState(manager, "tiny", "s09"))


def slow_down(manager: Any, seconds: float) -> None:
    """A slower decode step keeps requests in flight long enough to cancel them, drop them or
    kill the engine under them (with the engine in its own process, run there by `call`)."""
    engine = manager.engine
    fast = engine.decode_step_sessions
    engine.decode_step_sessions = lambda sessions: (time.sleep(seconds), fast(sessions))[1]


def in_process_texts(loaded: Any, requests: list[dict], max_new_tokens: int) -> list[str]:
    """The reference: stage 09's SchedulerManager in this process, greedy; `requests` are
    add_request keywords (`prompt` or `prompt_token_ids`)."""
    stage = registry.load_stage(9)
    engine = stage.InferenceEngine(loaded, max_batch_size=8, prefix_cache_max_entries=0)
    with stage.SchedulerManager(engine, max_batch_size=8) as manager:
        handles = [manager.add_request(**r, max_new_tokens=max_new_tokens) for r in requests]
        return [h.result(timeout=60).text for h in handles]


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


SAMPLE = re.compile(r'^(stagewise:[a-z0-9_]+)(\{[a-z_]+="[^"]*"\})? (\S+)$')


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (with its labels), after checking the format: each
    metric declared with a TYPE, histogram buckets cumulative and ending at +Inf = _count."""
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    types, samples = {}, {}
    for line in resp.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif not line.startswith("# HELP "):
            m = SAMPLE.match(line)
            assert m, f"not a Prometheus sample: {line!r}"
            name, labels, value = m.groups()
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types, f"{name} has no TYPE line"
            samples[name + (labels or "")] = float(value)
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket")]
            assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"]
            assert f'{name}_bucket{{le="+Inf"}}' in samples
    return samples
