"""Open the built docs site in a real headless browser (Debian's chromium), as a reader would,
with the network blocked: the site must stand on its own once set up.

Builds the site strictly into a temp dir, serves it on 127.0.0.1 (a free port), and opens every
page at 1280 px in one headless chromium driven over the DevTools protocol, every host but
127.0.0.1 unresolvable. For each page it saves a screenshot, then fails it on:

- a console error (an uncaught exception, `console.error`, a failed load: also any fetch from
  another host, since nothing should need one), or an image that did not load;
- a diagram left as text (mermaid is served from the site, docs/javascripts/);
- a table wider than the content column (every fold opened and every tab shown, so each is laid out);
- a "No committed result yet" note (a tab or section with nothing to show should not be there).

It also prints each page's teaching prose in words (docs_prose.py: outside code, tables and folds)
against the targets, which tests/test_docs_prose.py enforces without a browser.

    python scripts/docs_check.py [--out DIR] [--chromium PATH]      (make docs-check)

Look at the screenshots afterwards: a page can pass every check and still read badly.
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_prose  # noqa: E402  (beside this file)
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--hide-scrollbars",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]  # offline: only the site itself
WIDTH, MAX_SHOT_HEIGHT = 1280, 16000
PLACEHOLDER = "No committed result yet"
# After the screenshot: wait for the diagrams to draw, then open every fold and show every tab so
# that each table is laid out, and measure each against the box it scrolls in.
LAYOUT_JS = """(async () => {
  // The theme swaps a mermaid fence (a <pre> outside any highlighted code block) for a
  // <div class="mermaid"> holding the drawn SVG; one still a <pre> was never drawn.
  const undrawn = () => [...document.querySelectorAll(".md-content pre")].filter(p => !p.closest(".highlight"));
  const t0 = performance.now();
  while (undrawn().length && performance.now() - t0 < 15000) {
    await new Promise(r => setTimeout(r, 200));
  }
  const drawn = document.querySelectorAll(".md-content div.mermaid").length;
  document.querySelectorAll("details").forEach(d => { d.open = true; });
  const style = document.createElement("style");
  style.textContent = ".tabbed-set > .tabbed-content > .tabbed-block { display: block !important; }";
  document.head.appendChild(style);
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const wide = [...document.querySelectorAll(".md-content table")].map(t => {
    const box = t.closest(".md-typeset__scrollwrap") || t.parentElement;
    return {width: t.scrollWidth, column: box.clientWidth,
            head: (t.querySelector("tr") || t).innerText.replace(/\\s+/g, " ").slice(0, 60)};
  }).filter(t => t.width > t.column + 1);
  return {diagrams: drawn + undrawn().length, as_text: undrawn().length, wide,
          placeholder: document.body.innerText.includes("%s")};
})()""" % PLACEHOLDER
# Make lazy images load, wait for every image, report what each one got.
IMAGES_JS = """(async () => {
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => {
    i.addEventListener("load", r); i.addEventListener("error", r); setTimeout(r, 5000); })));
  return imgs.map(i => ({src: i.currentSrc || i.src, width: i.naturalWidth}));
})()"""


class DevTools:
    """The smallest websocket client that speaks the DevTools protocol (stdlib only, RFC 6455)."""

    def __init__(self, ws_url: str) -> None:
        u = urllib.parse.urlparse(ws_url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools handshake refused: {head[:200]!r}")
        self.next_id, self.events = 0, []

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("DevTools connection closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        n, mask = len(payload), os.urandom(4)  # client frames must be masked
        head = bytes([0x80 | opcode])
        head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 \
            else bytes([0x80 | 127]) + struct.pack(">Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _message(self) -> dict:
        data = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            n = struct.unpack(">H", self._read(2))[0] if n == 126 else struct.unpack(">Q", self._read(8))[0] \
                if n == 127 else n
            payload = self._read(n)
            opcode = b0 & 0x0F
            if opcode == 0x9:  # ping
                self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the connection")
            data += payload
            if b0 & 0x80:  # FIN: the message is complete
                return json.loads(data)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._send_frame(0x1, json.dumps(msg).encode())
        while True:
            reply = self._message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float) -> bool:
        """Collect events until `method` arrives (True) or the time is up (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("method") == method for e in self.events):
                return True
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                self.events.append(self._message())
            except (socket.timeout, TimeoutError):
                break
            finally:
                self.sock.settimeout(60)
        return any(e.get("method") == method for e in self.events)


def build_site(dest: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    cmd = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run(cmd + ["build", "--strict", "--quiet", "-d", str(dest)], cwd=ROOT, check=True, env=env)


def pages(site: Path) -> list[str]:
    """Every page of the site (home first), as URL paths relative to the root."""
    found = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.glob("*/**/index.html"))
    return [""] + found


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


def start_chromium(chromium: str, profile: Path) -> tuple[subprocess.Popen, DevTools]:
    proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.is_file() and len(port_file.read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
        time.sleep(0.1)
    port, path = port_file.read_text().splitlines()[:2]
    return proc, DevTools(f"ws://127.0.0.1:{port}{path}")


def errors_in(events: list[dict]) -> list[str]:
    """The console errors among a page's events."""
    found: list[str] = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            text = d.get("exception", {}).get("description") or d.get("text", "?")
            found.append(f"uncaught: {text.splitlines()[0]} ({d.get('url', '')})")  # first line: no stack
        elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            found.append("console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            found.append(f"{p['entry'].get('text', '')} ({p['entry'].get('url', '')})")
    return found


def check_page(dt: DevTools, url: str, shot: Path) -> tuple[list[str], dict]:
    """Problems found on one page (empty = fine), and facts worth printing (images, offline errors)."""
    target = dt.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = dt.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        for domain in ("Page", "Runtime", "Log"):
            dt.call(f"{domain}.enable", session=session)
        dt.call("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": 900, "deviceScaleFactor": 1,
                                                       "mobile": False}, session=session)
        dt.events.clear()
        nav = dt.call("Page.navigate", {"url": url}, session=session)
        if nav.get("errorText"):
            return [f"does not load: {nav['errorText']}"], {}
        if not dt.wait_for("Page.loadEventFired", 30):
            return ["no load event within 30 s"], {}
        images = dt.call("Runtime.evaluate", {"expression": IMAGES_JS, "awaitPromise": True, "returnByValue": True},
                         session=session)["result"].get("value", [])
        dt.wait_for("never", 1.0)  # late console messages (mermaid's loader, lazy scripts)
        height = dt.call("Runtime.evaluate", {"expression": "document.documentElement.scrollHeight",
                                              "returnByValue": True}, session=session)["result"]["value"]
        shot_data = dt.call("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WIDTH, "height": min(int(height), MAX_SHOT_HEIGHT), "scale": 1}},
            session=session)["data"]
        shot.write_bytes(base64.b64decode(shot_data))
        layout = dt.call("Runtime.evaluate", {"expression": LAYOUT_JS, "awaitPromise": True, "returnByValue": True},
                         session=session)["result"].get("value", {})
        problems = errors_in([e for e in dt.events if e.get("sessionId") == session])
        problems += [f"image did not load: {i['src']}" for i in images if not i["width"]]
        if layout.get("as_text"):
            problems.append(f"{layout['as_text']} of {layout['diagrams']} diagram(s) left as text")
        problems += [f"table {t['width']} px wide in a {t['column']} px column: {t['head']!r}" for t in layout.get("wide", [])]
        if layout.get("placeholder"):
            problems.append(f"a '{PLACEHOLDER}' note")
        ladder = [i for i in images if "ladder" in i["src"].rsplit("/", 1)[-1]]
        return problems, {"images": len(images), "ladder_chart": [i["width"] for i in ladder],
                          "diagrams": layout.get("diagrams", 0)}
    finally:
        dt.call("Target.closeTarget", {"targetId": target})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/stagewise-docs-check"), help="where the screenshots go")
    ap.add_argument("--chromium", default=CHROMIUM, help="the browser binary")
    args = ap.parse_args(argv)
    chromium = args.chromium if Path(args.chromium).exists() else shutil.which(args.chromium)
    if not chromium:
        print(f"{args.chromium} not found: install Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="stagewise-docs-") as tmp:
        site = Path(tmp) / "site"
        build_site(site)
        prose = {page: words for page, (words, _) in docs_prose.report(site).items()}
        for line in docs_prose.over_targets(site):
            print(f"note: {line}")
        server, base = serve(site)
        profile = Path(tmp) / "profile"  # a fresh browser profile every run
        proc, dt = start_chromium(chromium, profile)
        try:
            for page in pages(site):
                name = page.strip("/").replace("/", "_") or "index"
                shot = args.out / f"{name}.png"
                shot.unlink(missing_ok=True)
                problems, facts = check_page(dt, base + page, shot)
                failed += bool(problems)
                extra = f"  ladder chart width {facts['ladder_chart']}" if facts.get("ladder_chart") else ""
                words = prose.get(page)
                print(f"{'FAIL' if problems else 'ok  '}  /{page:42s} {facts.get('images', 0):2d} images "
                      f"{facts.get('diagrams', 0):2d} diagrams" + (f" {words:5d} words of prose" if words else "") + extra)
                for p in problems:
                    print(f"        {p}")
        finally:
            try:
                dt.call("Browser.close")
            except (OSError, ConnectionError, RuntimeError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            server.shutdown()
    print(f"{failed} page(s) failed; screenshots in {args.out}" if failed else f"all pages ok; screenshots in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
