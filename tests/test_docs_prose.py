"""scripts/docs_prose.py: the teaching prose of the built site, held to the docs' targets.

Why: a page teaches first; how its numbers were chased folds away. The counter must see only what
a reader reads top to bottom (not code, tables, result tabs or folded blocks), and the site must
keep the targets: every stage page at most 1,200 words and no commit hash in its prose, Serving
at most 2,000, the README at most 1,000.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
docs_prose = load_script("docs_prose")

PAGE = """<html><body><nav>menu words here</nav><article class="md-content__inner">
<h1>Title<a class="headerlink" href="#">¶</a></h1>
<p>One two three, with <code>inline_code</code> in it.</p>
<div class="highlight"><pre><code>not prose at all</code></pre></div>
<table><tr><td>cell words</td></tr></table>
<details class="note"><summary>Measurement notes</summary><p>folded away since 3d55ecd</p></details>
<div class="tabbed-set"><p>tab words</p></div>
<p>Measured at 80e3073, and 1234567 is a number.<br>End.</p>
</article></body></html>"""


def test_prose_is_what_a_reader_reads_top_to_bottom() -> None:
    text = docs_prose.prose(PAGE)
    for gone in ("menu", "not prose", "cell words", "folded away", "tab words", "¶"):
        assert gone not in text
    words, hashes = docs_prose.count(text)
    assert words == len("Title One two three with inline_code in it Measured at 80e3073 and 1234567 is a number End".split())
    assert hashes == ["80e3073"]  # a hex word with a letter and a digit; a plain number is not one


def test_readme_words_leave_its_code_out(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nTwo words.\n\n```bash\nmake bench and many more words\n```\n")
    assert docs_prose.readme_words(readme) == 3


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (the dev extra; a GPU machine's image has none)")
def test_the_built_site_keeps_the_prose_targets(tmp_path: Path) -> None:
    docs_check = load_script("docs_check")
    docs_check.build_site(tmp_path / "site")
    pages = docs_prose.report(tmp_path / "site")
    stage_pages = {p for p in pages if p.startswith("stages/")}
    assert len(stage_pages) == len(list((ROOT / "docs" / "stages").glob("*.md")))  # every page was read,
    assert all(pages[p][0] > 200 for p in stage_pages | {"serving/"})  # and its prose found
    assert docs_prose.over_targets(tmp_path / "site") == []
