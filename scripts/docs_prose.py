"""How much teaching prose each page of the built site holds, and whether it keeps to the targets.

    python scripts/docs_prose.py [SITE_DIR]      (default: builds the site into a temp dir)

Why: a page teaches first. Its prose (what a reader reads top to bottom) should say the idea,
show the code and one table, and stop; how a number was chased (reruns, drift, commits, what was
tried) folds away into a collapsed "Measurement notes" block or lives on Reproducing. So the
prose counted here is the text of the page's article outside code blocks, tables, result tabs
and collapsed blocks (`<details>`), and a commit hash in it is a lab note that escaped its fold.

Targets: every stage page at most 1,200 words with no commit hash; Serving at most 2,000;
README.md at most 1,000 (outside its code blocks). tests/test_docs_prose.py holds the site to
them, and `make docs-check` prints each page's count.
"""
from __future__ import annotations

import re
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_TAGS = {"pre", "table", "details", "script", "style", "svg", "nav"}
SKIP_CLASSES = ("tabbed-set", "highlight", "headerlink", "mermaid")
VOID = {"br", "img", "hr", "input", "meta", "link", "wbr", "source", "col"}
WORD = re.compile(r"[\w'’-]+")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # hex with a letter and a digit
STAGE_PAGE_WORDS, SERVING_WORDS, README_WORDS = 1200, 2000, 1000


class _Prose(HTMLParser):
    """The text of <article>, minus the elements above: a stack of 'is this skipped' per open tag."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[bool] = []
        self.articles = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID:
            return
        cls = dict(attrs).get("class") or ""
        self.articles += tag == "article"
        self.stack.append(tag in SKIP_TAGS or any(c in cls.split() for c in SKIP_CLASSES))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if self.stack:
            self.stack.pop()
        self.articles -= tag == "article"

    def handle_data(self, data: str) -> None:
        if self.articles > 0 and not any(self.stack):
            self.text.append(data)


def prose(html: str) -> str:
    parser = _Prose()
    parser.feed(html)
    return " ".join(parser.text)


def count(text: str) -> tuple[int, list[str]]:
    """(words, commit-hash-like tokens) of a text."""
    return len(WORD.findall(text)), HASH.findall(text)


def report(site: Path) -> dict[str, tuple[int, list[str]]]:
    """Every page of a built site, as its URL path ("" for home, "stages/03-paged-attention/"),
    to its prose's (words, hashes)."""
    out = {}
    for f in sorted(site.rglob("index.html")):
        page = f.parent.relative_to(site).as_posix() + "/"
        out["" if page == "./" else page] = count(prose(f.read_text()))
    return out


def readme_words(path: Path = ROOT / "README.md") -> int:
    """README.md's words outside its fenced code blocks."""
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.S | re.M)
    return len(WORD.findall(text))


def over_targets(site: Path) -> list[str]:
    """Every target a page (or the README) misses, one line each; empty when all are kept."""
    found = []
    for page, (words, hashes) in report(site).items():
        if page.startswith("stages/"):
            if words > STAGE_PAGE_WORDS:
                found.append(f"/{page}: {words} words of prose, more than {STAGE_PAGE_WORDS}")
            if hashes:
                found.append(f"/{page}: commit hashes in its prose: {', '.join(hashes)}")
        if page == "serving/" and words > SERVING_WORDS:
            found.append(f"/{page}: {words} words of prose, more than {SERVING_WORDS}")
    if (n := readme_words()) > README_WORDS:
        found.append(f"README.md: {n} words outside code, more than {README_WORDS}")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="stagewise-prose-") as tmp:
        site = Path(argv[0]) if argv else Path(tmp) / "site"
        if not argv:
            from docs_check import build_site  # noqa: PLC0415  (beside this file)
            build_site(site)
        for page, (words, hashes) in report(site).items():
            print(f"{words:6d} words {len(hashes):3d} hashes  /{page}")
        print(f"{readme_words():6d} words             README.md")
        missed = over_targets(site)
        print("\n".join(missed) or "every target kept")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
