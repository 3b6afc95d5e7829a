"""Open the built docs site in a real headless browser (Debian's chromium), as a reader would.

Builds the site into a temp dir, serves it on 127.0.0.1, and for the home page, every stage page,
the ladder page and one notebook page takes a screenshot and collects console errors. Exits 1
when a page does not load or has an uncaught JavaScript error.

    python scripts/docs_check.py [--out DIR] [--chromium PATH]

Look at the screenshots afterwards: a page can load without errors and still look wrong.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# The mermaid library is loaded from a CDN and this check may run without internet access (the
# development machine has none): failures to reach these hosts are expected, not page bugs.
OFFLINE_OK = ("cdn.jsdelivr.net", "unpkg.com", "unpkg")
CONSOLE = re.compile(r'CONSOLE\(\d+\)\] "(?P<msg>.*)", source: (?P<src>\S*)')


def build_site(dest: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    cmd = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    subprocess.run(cmd + ["build", "--strict", "--quiet", "-d", str(dest)], cwd=ROOT, check=True)


def pages(site: Path) -> list[str]:
    """Site-relative paths of the pages to check."""
    out = ["index.html"]
    out += sorted(str(p.relative_to(site)) for p in site.glob("stages/*/index.html"))
    out += [str(p.relative_to(site)) for p in sorted(site.glob("ladder/index.html"))]
    out += [str(p.relative_to(site)) for p in sorted(site.glob("notebooks/*/index.html"))[:1]]
    return out


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # chromium hangs up early: not an error
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def console_errors(stderr: str) -> list[str]:
    """Uncaught JS errors from chromium's stderr log, minus the ones caused by being offline."""
    errors = []
    for line in stderr.splitlines():
        if not ("CONSOLE" in line or ":ERROR:" in line) or "Uncaught" not in line:
            continue
        if any(host in line for host in OFFLINE_OK):
            continue
        m = CONSOLE.search(line)
        errors.append(f"{m['msg']} ({m['src']})" if m else line.strip())
    return errors


def check_page(chromium: str, url: str, shot: Path) -> list[str]:
    """Problems found on one page (empty = fine)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            if resp.status != 200:
                return [f"HTTP {resp.status}"]
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return [f"does not load: {exc}"]
    with tempfile.TemporaryDirectory(prefix="stagewise-chromium-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1280,2000",
               "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0", url]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return ["chromium timed out"]
    problems = console_errors(proc.stderr)
    if not shot.exists() or shot.stat().st_size == 0:
        problems.append(f"no screenshot (chromium exit {proc.returncode})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/stagewise-docs-check"), help="where the screenshots go")
    ap.add_argument("--chromium", default=CHROMIUM, help="the browser binary")
    args = ap.parse_args(argv)
    if not Path(args.chromium).exists() and not shutil.which(args.chromium):
        print(f"{args.chromium} not found: install Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stagewise-site-") as tmp:
        site = Path(tmp) / "site"
        build_site(site)
        server, base = serve(site)
        failed = 0
        try:
            for page in pages(site):
                name = page.removesuffix("index.html").strip("/").replace("/", "_") or "index"
                shot = args.out / f"{name}.png"
                shot.unlink(missing_ok=True)
                problems = check_page(args.chromium, base + page.removesuffix("index.html"), shot)
                failed += bool(problems)
                print(f"{'FAIL' if problems else 'ok  '}  {page:55s} {shot}")
                for p in problems:
                    print(f"        {p}")
        finally:
            server.shutdown()
    print(f"{failed} page(s) failed; screenshots in {args.out}" if failed else f"all pages ok; screenshots in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
