"""Measure every committed result again, from one clean commit, one command at a time.

    python scripts/rerun_results.py --list              # the commands, in order; nothing runs
    python scripts/rerun_results.py                     # all of them (make results)
    python scripts/rerun_results.py --only ladder       # those whose file name contains 'ladder'
    python scripts/rerun_results.py --check             # which commit each result is from
    python scripts/rerun_results.py --resume            # only those not yet from this commit
    python scripts/rerun_results.py --like cpu --device cuda   # on a GPU: the CPU set's commands, *.cuda.json

Why: a page's figures should come from one version of the code, or a reader cannot tell what a
change did from what happened between two commits. Every file under `docs/results/` says how it
was made: its `command`, or a `config` from which the pages rebuild the command they print
(`command_from` in docs/hooks/stagewise_commands.py, the same function here). This runs those
commands again, in this checkout, and then checks that every file it rewrote names the same
clean commit. It reruns the current set of one device, `docs/results/<device>/`; the other
machines' sets (`machines/`) and the before/after pairs (`questions/`) are left alone: each
belongs to the machine or the commit it compares.

Each command runs in a fresh Python started here (`python -m common.cli ...`, `python -m
stages...`), so the code measured is this checkout's, not that of whatever checkout a `stagewise`
script on the PATH was installed from. Run nothing else meanwhile: on a small machine another
program's CPU is this run's noise. On a 2-core CPU the whole set takes two to three hours
(the three ladders recorded with --rounds 3 take about twice their one-round time); it can be
split over sittings at one commit: `--only`/`--skip` now, `--resume` later in a checkout of that
commit holding the files written so far (files under docs/results/ do not make a checkout dirty).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
from stagewise_commands import command_from, placed  # noqa: E402  (the pages' own reading of a result)


def result_files(device: str) -> list[Path]:
    """The current set of one device: `docs/results/<device>/<name>.<device>[.<tag>].json`."""
    return sorted(p for p in (RESULTS / device).glob("*.json") if f".{device}." in p.name)


def argv_for(path: Path, target: Path | None = None) -> list[str]:
    """The command that wrote `path`, as argv for this interpreter, writing `target` (default: `path` again)."""
    data = json.loads(path.read_text())
    words = shlex.split(command_from(data))
    if words[1:2] == ["serve-compare"] and not any(w.startswith("--stage") for w in words) and data.get("stage"):
        # Recorded before serve-compare named its stage: it measured the newest stage of its day, not today's.
        words += ["--stage", data["stage"][1:3]]
    if words[0] == "stagewise":
        words = ["-m", "common.cli", *words[1:]]
    elif words[:2] == ["python", "-m"]:
        words = words[1:]
    else:
        raise SystemExit(f"{path.name}: cannot rerun {shlex.join(words)!r}")
    return [sys.executable, *placed(words, (target or path).relative_to(ROOT).as_posix())]


def provenance(path: Path) -> tuple[str, bool, bool]:
    """(commit, dirty, code changed during the run) as the result recorded them."""
    env = json.loads(path.read_text()).get("env") or {}
    return env.get("git_commit") or "?", bool(env.get("git_dirty")), bool(env.get("code_changed_during_run"))


def check(paths: list[Path], head: str | None) -> int:
    """Print each result's commit; 1 if any differs from `head` (or from the others), or is dirty."""
    commits = {p: provenance(p) for p in paths}
    want = head or Counter(c for c, _, _ in commits.values()).most_common(1)[0][0]
    bad = 0
    for p, (commit, dirty, moved) in commits.items():
        flag = "" if commit == want and not dirty and not moved else "  <-- " + (
            "dirty" if dirty else "code changed during the run" if moved else "another commit")
        bad += bool(flag)
        print(f"{commit[:10]}  {p.name}{flag}")
    print(f"{len(paths) - bad} of {len(paths)} results from {want[:10]}, clean")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="which results: cpu or cuda (the file names say)")
    p.add_argument("--only", action="append", default=[], help="file names containing this (repeatable)")
    p.add_argument("--skip", action="append", default=[], help="file names not containing this (repeatable)")
    p.add_argument("--list", action="store_true", help="print the commands and stop")
    p.add_argument("--check", action="store_true", help="print which commit each result is from and stop")
    p.add_argument("--resume", action="store_true",
                   help="skip results already from this commit, clean (a set split over several sittings)")
    p.add_argument("--allow-dirty", action="store_true", help="run in a checkout with uncommitted changes")
    p.add_argument("--like", default=None, metavar="DEVICE",
                   help="run the commands of DEVICE's results (e.g. cpu) to write --device's files: a first "
                        "CUDA set is `--like cpu --device cuda` on a GPU machine (the commands say --device auto)")
    args = p.parse_args(argv)

    source = args.like or args.device
    paths = [f for f in result_files(source)
             if (not args.only or any(s in f.name for s in args.only)) and not any(s in f.name for s in args.skip)]
    if args.check:
        return check(paths, None)
    sys.path.insert(0, str(ROOT))
    from common.bench.envinfo import git_info  # also where the checkout is a copy without .git (scripts/README.md)

    here = git_info()
    head = here["git_commit"]
    targets = {f: RESULTS / args.device / f.name.replace(f".{source}.", f".{args.device}.", 1) for f in paths}
    if args.resume:
        paths = [f for f in paths if not (targets[f].exists() and provenance(targets[f]) == (head, False, False))]
    plan = [(targets[f], argv_for(f, targets[f])) for f in paths]
    if args.list:
        for f, cmd in plan:
            print(shlex.join(["python", *cmd[1:]]))
        return 0
    # As in common/bench/envinfo.py: the results themselves (rewritten as the set goes) do not count.
    if args.like and args.device != args.like:
        import torch  # the commands pick their device with --device auto: it must be the one the names say

        found = "cuda" if torch.cuda.is_available() else "cpu"
        if found != args.device:
            raise SystemExit(f"rerun_results: --device {args.device}, but this machine runs on {found}")
    if here["git_dirty"] is None and not args.allow_dirty:
        raise SystemExit("rerun_results: no .git here to say which commit this is; a copy of a clean "
                         "checkout says it with STAGEWISE_GIT_COMMIT=<sha> STAGEWISE_GIT_DIRTY=0 (scripts/README.md)")
    if here["git_dirty"] and not args.allow_dirty:
        raise SystemExit("rerun_results: the checkout has uncommitted changes; commit them first, so the "
                         "results name the code they measured (or --allow-dirty)")
    t_all, times = time.perf_counter(), []
    for k, (f, cmd) in enumerate(plan, 1):
        print(f"\n##### [{k}/{len(plan)}] {f.name}\n##### {shlex.join(['python', *cmd[1:]])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        times.append((f.name, time.perf_counter() - t0, rc))
        if rc:
            print(f"##### {f.name}: exit code {rc}; going on with the rest", flush=True)
    print(f"\n##### done in {(time.perf_counter() - t_all) / 60:.1f} min")
    for name, secs, rc in times:
        print(f"{secs / 60:7.1f} min  {'ok ' if rc == 0 else f'rc={rc}'}  {name}")
    return check([target for target, _ in plan], head) or max((rc for _, _, rc in times), default=0)


if __name__ == "__main__":
    sys.exit(main())
