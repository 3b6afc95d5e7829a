"""The docs hook (docs/hooks/stagewise.py): diffs, includes and result tables render as promised.

Why: the site's promise is that nothing on it is pasted. Diffs come from the code and numbers
from committed JSON. These tests pin the directive behaviour without running a full mkdocs build
(`make test` runs `mkdocs build --strict` for that).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs" / "hooks"))

import stagewise as hook  # noqa: E402
import stagewise_commands as commands  # noqa: E402
import stagewise_results as results  # noqa: E402
import stagewise_values as values  # noqa: E402

SAMPLE = "tests/data/sample_result.json"


def _sample() -> dict:
    return json.loads((REPO / SAMPLE).read_text())


@pytest.fixture
def two_stages(tmp_path: Path) -> Path:
    """A fake repo with two small stage directories one idea apart."""
    a, b = tmp_path / "stages" / "s01_alpha", tmp_path / "stages" / "s02_beta"
    for d in (a, b):
        (d / "__pycache__").mkdir(parents=True)
        (d / "same.py").write_text("X = 1\n")
        (d / "__pycache__" / "junk.py").write_text(f"junk in {d.name}\n")
        (d / "notes.txt").write_text(f"not python: {d.name}\n")
    (a / "engine.py").write_text("def step(x):\n    return x + 1\n")
    (b / "engine.py").write_text("def step(x):\n    # cached now\n    return x + 2\n")
    (b / "kv_cache.py").write_text("class Cache:\n    pass\n")
    return tmp_path


# ----------------------------------------------------------------------------- stage diffs
def test_stage_diff_renders_unified_diff_of_python_files(two_stages: Path) -> None:
    md = hook.render_stage_diff(two_stages, "s01_alpha", "s02_beta")
    assert "```diff" in md
    assert "diff -ru stages/s01_alpha/engine.py stages/s02_beta/engine.py" in md
    assert "--- stages/s01_alpha/engine.py" in md and "+++ stages/s02_beta/engine.py" in md
    assert "-    return x + 1" in md and "+    return x + 2" in md and "+    # cached now" in md
    assert "Only in stages/s02_beta: kv_cache.py" in md
    assert "same.py" not in md  # identical files do not appear, as with diff -ru
    assert "junk" not in md and "__pycache__" not in md and "notes.txt" not in md
    assert "| `engine.py` | changed | +2 | −1 |" in md
    assert "| `kv_cache.py` | new | +2 | — |" in md


def test_stage_diff_folds_each_file_engine_first_tests_last(two_stages: Path) -> None:
    """A page shows its idea's code above; the diff is every changed line, one folded file at a time."""
    (two_stages / "stages" / "s01_alpha" / "test_stage.py").write_text("def test_a():\n    assert 1\n")
    (two_stages / "stages" / "s02_beta" / "test_stage.py").write_text("def test_b():\n\n    assert 2\n")
    md = hook.render_stage_diff(two_stages, "s01_alpha", "s02_beta")
    folds = [line for line in md.splitlines() if line.startswith("??? note")]
    assert folds == ['??? note "`engine.py` (+2 −1)"', '??? note "`kv_cache.py` (+2 −0)"',
                     '??? note "The tests: `test_stage.py` (+3 −2)"']
    assert not [line for line in md.splitlines() if line.startswith("```")]  # no diff left unfolded


def test_stage_diff_folds_the_tests_away_from_the_code(two_stages: Path) -> None:
    (two_stages / "stages" / "s01_alpha" / "test_stage.py").write_text("def test_a():\n    assert 1\n")
    (two_stages / "stages" / "s02_beta" / "test_stage.py").write_text("def test_b():\n\n    assert 2\n")
    md = hook.render_stage_diff(two_stages, "s01_alpha", "s02_beta")
    code, _, tests = md.partition('??? note "The tests: `test_stage.py` (+3 −2)')
    assert tests, md
    assert "engine.py" in code and "| `test_stage.py` | changed |" in code and "def test_" not in code
    body = tests.split("\n")[2:]
    assert body[0] == "    ```diff" and all(line.startswith("    ") for line in body)
    assert "    +def test_b():" in body and "    -def test_a():" in body


def test_stage_diff_accepts_stages_prefix_and_reports_no_difference(two_stages: Path) -> None:
    md = hook.render_stage_diff(two_stages, "stages/s01_alpha", "stages/s01_alpha")
    assert "No differences" in md


def test_stage_diff_missing_dir_fails_strict_and_notes_otherwise(two_stages: Path) -> None:
    with pytest.raises(hook.DocsError, match="s09_missing"):
        hook.render_stage_diff(two_stages, "s01_alpha", "s09_missing")
    md = hook.render_stage_diff(two_stages, "s01_alpha", "s09_missing", strict=False)
    assert md.startswith('!!! note "Stage not built yet"') and "s09_missing" in md


def test_diff_fence_outgrows_backticks_in_the_code(tmp_path: Path) -> None:
    for name, body in (("s01_a", 'DOC = "```"\n'), ("s02_b", 'DOC = "````"\n')):
        (tmp_path / "stages" / name).mkdir(parents=True)
        (tmp_path / "stages" / name / "m.py").write_text(body)
    md = hook.render_stage_diff(tmp_path, "s01_a", "s02_b")
    assert "`````diff" in md


# ----------------------------------------------------------------------------- includes
def test_include_whole_file_symbol_and_missing(two_stages: Path) -> None:
    md = hook.render_include(two_stages, "stages/s02_beta/engine.py")
    assert md.startswith('```python title="stages/s02_beta/engine.py"') and "return x + 2" in md
    md = hook.render_include(two_stages, "stages/s02_beta/kv_cache.py::Cache")
    assert 'title="stages/s02_beta/kv_cache.py · Cache"' in md and "class Cache:" in md
    note = hook.render_include(two_stages, "stages/s03_gamma/engine.py")
    assert note.startswith('!!! note "Not built yet"')
    with pytest.raises(hook.DocsError):
        hook.render_include(two_stages, "stages/s03_gamma/engine.py", strict=True)


def test_extract_symbol_methods_assignments_and_decorators() -> None:
    src = (
        "import x\n\nCHANGES: list[str] = ['a.py']\n\n"
        "class Engine:\n    @staticmethod\n    def run(a):\n        return a\n\n    def other(self):\n        pass\n"
    )
    assert hook.extract_symbol(src, "CHANGES") == "CHANGES: list[str] = ['a.py']"
    assert hook.extract_symbol(src, "Engine.run") == "@staticmethod\ndef run(a):\n    return a"
    with pytest.raises(hook.DocsError, match="nope"):
        hook.extract_symbol(src, "Engine.nope")


# ----------------------------------------------------------------------------- results
def test_env_line_names_the_cpu_generation_and_kernels_where_recorded() -> None:
    env = {"cpu_model": "AMD EPYC", "cpu_family_model": "25/17", "cpu_capability": "AVX512", "torch_threads": 2}
    assert "CPU AMD EPYC (family/model 25/17, AVX512 kernels)" in results.env_line({"env": env})
    assert "CPU AMD EPYC · 2 threads" in results.env_line({"env": {"cpu_model": "AMD EPYC", "torch_threads": 2}})


def test_env_line_says_which_dtype_and_why() -> None:
    data = {"env": {}, "model": "smollm2-135m", "dtype": "bfloat16", "dtype_reason": "auto: bfloat16, this CPU has bf16 matmul units"}
    assert results.env_line(data).endswith("model `smollm2-135m` bfloat16 (auto: bfloat16, this CPU has bf16 matmul units)")
    assert results.env_line({"env": {}, "model": "tiny", "dtype": "float32"}).endswith("model `tiny` float32")


def test_bench_results_table_from_sample_json() -> None:
    data = _sample()
    md = results.render_bench_results(REPO, SAMPLE, "stages/02-kv-cache.md")
    # the command, rebuilt from `config`
    assert "python -m stages.s02_kv_cache.bench" in md and "--compare" in md and "--baseline hf" in md
    assert "--no-stop-on-eos" in md and "--tokenize-workers" not in md  # offline run: no streaming flags
    # the environment line
    assert f"commit `{data['env']['git_commit'][:10]}`" in md
    assert data["env"]["cpu_model"] in md and "torch 2.13.0" in md and "2 threads" in md
    # the metrics table: medians with the spread over runs
    ttft = data["ttft_ms"]["p50"]
    lo = min(r["ttft_ms"]["p50"] for r in data["runs"])
    hi = max(r["ttft_ms"]["p50"] for r in data["runs"])
    assert f"| TTFT (ms) | {ttft:,.2f} <small>({lo:,.2f}–{hi:,.2f})</small>" in md
    assert "| Prefill → first token (ms) |" in md and "| Queue wait, post-tok (ms) |" in md
    assert f"{data['throughput_tok_s']['completion']:,.2f}" in md
    # the link to the raw JSON is relative to the page
    assert "](../../tests/data/sample_result.json)" in md


def test_bench_results_side_by_side_ratios_favour_this_stage_above_one() -> None:
    data = _sample()
    md = results.render_bench_results(REPO, SAMPLE, "stages/02-kv-cache.md")
    assert "× vs `s01_naive_batching`" in md and "× vs `hf_generate`" in md
    hf = next(c for c in data["compare"] if c["engine"] == "hf_generate")
    thr = data["throughput_tok_s"]["completion"] / hf["throughput_tok_s"]["completion"]
    ttft = hf["ttft_ms"]["p50"] / data["ttft_ms"]["p50"]
    row = next(line for line in md.splitlines() if line.startswith("| Throughput, completion"))
    assert row.rstrip(" |").endswith(f"{thr:.2f}×")
    row = next(line for line in md.splitlines() if line.startswith("| TTFT p50"))
    assert row.rstrip(" |").endswith(f"{ttft:.2f}×")
    assert "Correctness, checked before timing" in md


def test_missing_result_json_gives_admonition_with_command(tmp_path: Path) -> None:
    md = results.render_bench_results(tmp_path, "docs/results/cpu/s02_kv_cache.cpu.json")
    assert md.startswith('!!! warning "No committed result yet"')
    assert "python -m stages.s02_kv_cache.bench --compare --json docs/results/cpu/s02_kv_cache.cpu.json" in md
    md = results.render_bench_results(tmp_path, "docs/results/cuda/s07_x.cuda.json", command="make it so")
    assert "make it so" in md
    assert "--device cuda" in commands.default_command("docs/results/cuda/s07_x.cuda.json")


def test_bench_tabs_show_a_later_tab_only_once_its_result_is_committed(tmp_path: Path) -> None:
    args = "CPU docs/results/cpu/s02_x.cpu.json | CUDA, H200 docs/results/cuda/s02_x.cuda.json"
    md = hook.render_bench_tabs(tmp_path, args, "stages/02.md")
    assert md.startswith('=== "CPU"') and "No committed result yet" in md
    assert '=== "CUDA, H200"' not in md
    for path in ("docs/results/cpu/s02_x.cpu.json", "docs/results/cuda/s02_x.cuda.json"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(json.dumps(_sample()))
    md = hook.render_bench_tabs(tmp_path, args, "stages/02.md")
    assert '=== "CPU"' in md and '=== "CUDA, H200"' in md and "No committed result yet" not in md
    body = md.split('=== "CUDA, H200"')[1].splitlines()[2:]
    assert body and all(line.startswith("    ") or not line for line in body)  # inside the tab
    with pytest.raises(results.DocsError, match="LABEL"):
        hook.render_bench_tabs(tmp_path, "docs/results/cpu/s02_x.cpu.json", "stages/02.md")


def test_a_results_command_writes_where_the_result_lies_now() -> None:
    """A result written to a scratch path, or moved since (docs/results/ is laid out by device,
    machine and question), prints the command that writes this very file: the one a reader copies."""
    bench = {"command": "stagewise serve-overhead --stage 9 --json /tmp/x.json"}
    assert commands.placed_command(bench, "docs/results/cpu/serve.cpu.json") == \
        "stagewise serve-overhead --stage 9 --json docs/results/cpu/serve.cpu.json"
    ladder = {"command": "stagewise ladder --workload burst --out docs/results --tag"}
    assert commands.placed_command(ladder, "docs/results/cpu/ladder.cpu.burst.json") == \
        "stagewise ladder --workload burst --out docs/results/cpu --tag"


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"stage": "s02_kv_cache"}', "throughput_tok_s"),
])
def test_malformed_result_json_fails(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "bad.json").write_text(text)
    with pytest.raises(results.DocsError, match=match):
        results.render_bench_results(tmp_path, "docs/results/bad.json")


def test_malformed_compare_entry_fails(tmp_path: Path) -> None:
    data = _sample()
    del data["compare"][0]["ttft_ms"]
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(results.DocsError, match="compare"):
        results.render_bench_results(tmp_path, "r.json")


def test_bench_value_and_ratio_lookups(tmp_path: Path) -> None:
    data = _sample()
    assert values.render_bench_value(REPO, f"{SAMPLE} ttft_ms.p99") == f"{data['ttft_ms']['p99']:.2f}"
    s01 = data["compare"][0]
    assert values.render_bench_value(REPO, f"{SAMPLE} compare.s01_naive_batching.tpot_ms.p50") \
        == f"{s01['tpot_ms']['p50']:.2f}"
    assert values.render_bench_value(REPO, f"{SAMPLE} compare.0.tpot_ms.p50") == f"{s01['tpot_ms']['p50']:.2f}"
    ratio = s01["ttft_ms"]["p50"] / data["ttft_ms"]["p50"]
    assert values.render_bench_ratio(REPO, f"{SAMPLE} compare.s01_naive_batching.ttft_ms.p50 ttft_ms.p50") \
        == f"{ratio:.2f}×"
    # across two files: a key of one over a key of the other (here the same file twice)
    assert values.render_bench_ratio(REPO, f"{SAMPLE} compare.s01_naive_batching.ttft_ms.p50 {SAMPLE} ttft_ms.p50") \
        == f"{ratio:.2f}×"
    assert values.render_bench_ratio(tmp_path, "docs/results/none.json ttft_ms.p50 docs/results/none.json ttft_ms.p50") \
        == "*pending*"
    with pytest.raises(results.DocsError, match="bench-ratio: expected"):
        values.render_bench_ratio(REPO, f"{SAMPLE} ttft_ms.p50")
    with pytest.raises(results.DocsError, match="no key"):
        values.render_bench_value(REPO, f"{SAMPLE} ttft_ms.p42")
    with pytest.raises(results.DocsError, match="not a number"):
        values.render_bench_value(REPO, f"{SAMPLE} stage")
    assert values.render_bench_value(tmp_path, "docs/results/none.json ttft_ms.p50") == "*pending*"
    assert values.render_bench_value(REPO, f"{SAMPLE} requests") == f"{data['requests']}"  # a count: no decimals
    assert values.render_bench_value(REPO, f"{SAMPLE} requests KiB") == f"{data['requests'] / 1024:.1f} KiB"
    assert values.render_bench_value(REPO, f"{SAMPLE} requests %") == f"{data['requests'] * 100:.1f} %"
    with pytest.raises(results.DocsError, match="expected"):
        values.render_bench_value(REPO, f"{SAMPLE} requests GB")


def test_lookup_finds_a_profile_row_by_its_op_name() -> None:
    """A profile's op rows reorder between runs, so a page names the op, not its place."""
    profile = {"ops": [{"op": "aten::copy_", "ms_per_step": 9.0}, {"op": "aten::index_select", "ms_per_step": 7.5}]}
    assert results.lookup(profile, "ops.aten::index_select.ms_per_step") == 7.5
    assert results.lookup(profile, "ops.0.ms_per_step") == 9.0
    with pytest.raises(results.DocsError, match="no key"):
        results.lookup(profile, "ops.aten::mul.ms_per_step")
    twice = {"ops": profile["ops"] + [{"op": "aten::copy_", "ms_per_step": 1.0}]}
    with pytest.raises(results.DocsError, match="2 items named"):
        results.lookup(twice, "ops.aten::copy_.ms_per_step")


def test_ladder_chart_and_table_missing_then_present(tmp_path: Path) -> None:
    assert "Ladder chart not committed yet" in hook.render_ladder_chart(tmp_path, "", "index.md")
    assert "No committed result yet" in hook.render_ladder_table(tmp_path, "", "ladder.md")
    out = tmp_path / "docs" / "results" / "cpu"
    out.mkdir(parents=True)
    (out / "ladder.cpu.png").write_bytes(b"\x89PNG")
    assert "](results/cpu/ladder.cpu.png)" in hook.render_ladder_chart(tmp_path, "", "index.md")
    entry = {k: _sample()[k] for k in ("throughput_tok_s", "ttft_ms", "tpot_ms", "kv")}
    (out / "ladder.cpu.json").write_text(json.dumps({"entries": [{"engine": "s02_kv_cache", **entry}]}))
    assert "| `s02_kv_cache` |" in hook.render_ladder_table(tmp_path, "", "ladder.md")
    (out / "ladder.cpu.json").write_text(json.dumps({"entries": []}))
    with pytest.raises(results.DocsError):
        hook.render_ladder_table(tmp_path, "", "ladder.md")


def test_ladder_table_is_two_narrow_tables_and_the_chart_links_full_size(tmp_path: Path) -> None:
    """Eleven columns overflowed a 688 px column at 1280 px; two tables of at most six fit."""
    out = tmp_path / "docs" / "results" / "cpu"
    out.mkdir(parents=True)
    entry = {k: _sample()[k] for k in ("throughput_tok_s", "ttft_ms", "tpot_ms", "kv")}
    rows = [{"engine": "s02_kv_cache", **entry}, {"engine": "s04_online_scheduler", "mode": "streaming", **entry}]
    (out / "ladder.cpu.json").write_text(json.dumps({"entries": rows}))
    lines = hook.render_ladder_table(tmp_path, "", "ladder.md").splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("| engine |")]
    assert len(heads) == 2
    for h in heads:
        width = lines[h].count("|")
        assert width - 1 <= 6 and [line.count("|") for line in lines[h:h + 4]] == [width] * 4
        assert "`s04_online_scheduler` (streaming)" in lines[h + 3]
    (out / "ladder.cpu.png").write_bytes(b"\x89PNG")
    chart = hook.render_ladder_chart(tmp_path, "", "index.md")
    assert chart.startswith("[![") and "](results/cpu/ladder.cpu.png \"the chart at full size\")" in chart


def test_parity_table_missing_then_present(tmp_path: Path) -> None:
    path = "docs/results/cpu/parity.bf16.cpu.json"
    missing = hook.render_parity_table(tmp_path, path, "reproducing.md")
    assert "No committed result yet" in missing
    assert "stagewise parity --model smollm2-135m --dtype bfloat16 --device cpu --json " + path in missing
    (tmp_path / path).parent.mkdir(parents=True)
    same = {"requests": 4, "identical": 4, "first_tokens_equal": 4, "agreement": 1.0, "differences": []}
    differs = {"requests": 4, "identical": 3, "first_tokens_equal": 4, "agreement": 0.875,
               "differences": [{"request": 2, "first_difference": 5, "reference_margin": 0.0625}]}
    data = {"kind": "parity", "prompt_lengths": [3, 40], "entries": {"s02_kv_cache": same, "s03_paged_attention": differs}}
    (tmp_path / path).write_text(json.dumps(data))
    table = hook.render_parity_table(tmp_path, path, "reproducing.md")
    assert "| `s02_kv_cache` | 4/4 | 4/4 | 100.0 % | — |" in table
    assert "| `s03_paged_attention` | 3/4 | 4/4 | 87.5 % | #2 @ 5 (0.062) |" in table
    (tmp_path / path).write_text(json.dumps({**data, "kind": "bench"}))
    with pytest.raises(results.DocsError, match="parity"):
        hook.render_parity_table(tmp_path, path, "reproducing.md")


def test_serve_pairs_one_row_per_pair_missing_then_present(tmp_path: Path) -> None:
    path = "docs/results/cpu/serve.cpu.json"
    assert "stagewise serve-overhead" in hook.render_serve_pairs(tmp_path, path, "serving.md")
    (tmp_path / path).parent.mkdir(parents=True)
    pair = {"first": "http", "prefill_p50_ms": {"http": 500.0, "in_process": 510.0},
            "ttft_p50_outside_prefill_ms": {"http": 15.0, "in_process": 9.5}, "ttft_p50_added_ms": 5.5,
            "ttft_p50_added_raw_ms": -4.5, "throughput_loss_pct": 1.25,
            "intake_span_ms": {"http": 4.0, "in_process": 3.0}}
    pairs = [{**pair, "first": "in-process"}, pair, pair]
    (tmp_path / path).write_text(json.dumps({"kind": "serve-overhead", "overhead": {"pairs": pairs}}))
    first, second = hook.render_serve_pairs(tmp_path, path, "serving.md").split("\n\n")[::2]
    for table in (first.splitlines(), second.splitlines()):
        assert len(table) == 2 + 3  # heading, rule, one row per pair: as many as the run had
        assert {line.count("|") for line in table} == {table[0].count("|")} and table[0].count("|") <= 7
    assert first.splitlines()[2] == "| 1 | in-process | 510.00 | 500.00 | 9.50 | 15.00 |"
    assert second.splitlines()[2] == "| 1 | 5.50 | -4.50 | 1.25 % | 3.00 | 4.00 |"
    assert first.splitlines()[4].startswith("| 3 | HTTP |")
    del pairs[1]["intake_span_ms"]
    (tmp_path / path).write_text(json.dumps({"kind": "serve-overhead", "overhead": {"pairs": pairs}}))
    with pytest.raises(results.DocsError, match="pair 2"):
        hook.render_serve_pairs(tmp_path, path, "serving.md")


# ----------------------------------------------------------------------------- expansion
def test_expand_keeps_indentation_skips_fences_and_rejects_inline_blocks(two_stages: Path) -> None:
    md = (
        '=== "CPU"\n\n    <!-- bench-results: docs/results/none.json -->\n\n'
        "```markdown\n<!-- stage-diff: s01_alpha s02_beta -->\n```\n"
    )
    out = hook.expand(md, two_stages, "stages/x.md")
    assert '\n    !!! warning "No committed result yet"\n' in out
    assert "\n        python -m stages.none.bench" in out  # the admonition body, indented inside the tab
    assert "```markdown\n<!-- stage-diff: s01_alpha s02_beta -->\n```" in out  # untouched in a fence
    with pytest.raises(hook.DocsError, match="alone on its line"):
        hook.expand("text <!-- stage-diff: s01_alpha s02_beta --> text", two_stages)
    assert hook.expand("a | <!-- bench-value: none.json x.y --> |", two_stages) == "a | *pending* |"


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for v in nav.values() for f in _nav_files(v)]
    return []


def test_every_nav_page_exists_and_uses_only_known_directives() -> None:
    cfg = _mkdocs_config()
    pages = _nav_files(cfg["nav"])
    stage_dirs = [p for p in (REPO / "stages").glob("s[0-9]*_*") if p.is_dir()]
    assert len([p for p in pages if p.startswith("stages/")]) == len(stage_dirs)  # one page per stage, all in the nav
    known = set(hook.BLOCK + hook.INLINE)
    for page in pages:
        text = (REPO / "docs" / page).read_text()
        for name in re.findall(r"<!--\s*([a-z-]+)\s*:", text):
            assert name in known, f"docs/{page}: unknown directive {name!r}"
    assert "docs/hooks/stagewise.py" in cfg["hooks"]


def test_stage_pages_use_strict_directives_and_the_committed_result_names() -> None:
    """Every stage page's stage exists: a renamed symbol or stage must fail the build, not show a note."""
    stage_dirs = sorted(p.name for p in (REPO / "stages").glob("s[0-9]*_*") if p.is_dir())
    pages = sorted((REPO / "docs" / "stages").glob("*.md"))
    assert stage_dirs and len(stage_dirs) == len(pages)  # one page per stage dir, in the same order
    for i, (stage, page) in enumerate(zip(stage_dirs, pages)):
        text = page.read_text()
        assert "-if-present" not in text, f"{page.name}: use the strict directives"
        assert f"<!-- bench-tabs: CPU docs/results/cpu/{stage}.cpu.json | CUDA docs/results/cuda/{stage}.cuda.json" in text, page.name
        assert re.search(rf"<!-- include: stages/{stage}/\S+::\S+ -->", text), f"{page.name}: no symbol include"
        if i:
            assert f"<!-- stage-diff: {stage_dirs[i - 1]} {stage} -->" in text, page.name


def test_mermaid_is_served_from_the_site_and_is_the_pinned_file() -> None:
    """Offline, the theme would fetch mermaid from a CDN and leave every diagram as text; the
    site carries mermaid itself, the file mkdocs.yml names (tests/test_docs_check.py sees them drawn)."""
    import hashlib

    config = (REPO / "mkdocs.yml").read_text()
    assert "  - javascripts/mermaid-11.17.2.min.js" in config and "font: false" in config
    data = (REPO / "docs" / "javascripts" / "mermaid-11.17.2.min.js").read_bytes()
    assert hashlib.sha256(data).hexdigest() == "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"


def test_bench_range_quoted_keys_and_arithmetic(tmp_path: Path) -> None:
    """A range over results, a key with a space, and a quantity derived from keys: the figures
    the pages used to type by hand ("55 to 68 %", "±12.0 %", "0.44-0.87 of the floor")."""
    (tmp_path / "a.json").write_text(json.dumps({"x": 0.5, "y": 2.0, "s": {"compl tok/s": {"dev": 12.0}}}))
    (tmp_path / "b.json").write_text(json.dumps({"x": 0.25, "y": 4.0, "pairs": [{"z": 3.5}, {"z": -1.5}, {"z": 2}]}))
    assert values.render_bench_range(tmp_path, "b.json pairs.*.z") == "\u22121.50 to 3.50"  # over a list's items
    assert values.render_bench_range(tmp_path, 'b.json "=pairs.*.z - pairs.*.z + x"') == "0.25 to 0.25"  # same item
    (tmp_path / "n.json").write_text(json.dumps({"runs": [{"p": [{"x": 1}, {"x": 2}]}, {"p": [{"x": 3}]}], "inf": 1e999}))
    assert values.render_bench_range(tmp_path, "n.json runs.*.p.*.x") == "1 to 3"  # a plain key walks every list
    (tmp_path / "s.json").write_text(json.dumps({"samples": [2.5, 1.5, 4.0], "one": 3, "rows": [{"s": [7, 5]}]}))
    assert values.render_bench_range(tmp_path, "s.json samples.*") == "1.50 to 4.00"  # a list of numbers' items
    assert values.render_bench_range(tmp_path, "s.json rows.0.s.*") == "5 to 7"
    assert values.render_bench_range(tmp_path, "s.json rows.*.s.*") == "5 to 7"  # each item's list, walked
    (tmp_path / "r.json").write_text(json.dumps({"t": {"split": [1.0, 3.0], "one": [2.0, 4.0]}}))
    assert values.render_bench_range(tmp_path, 'r.json "=t.split.* / t.one.*"') == "0.50 to 0.75"  # two lists, item by item
    (tmp_path / "u.json").write_text(json.dumps({"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0], "x": 0.5}))
    with pytest.raises(results.DocsError, match="differ in length"):  # not cut to the shorter one
        values.render_bench_range(tmp_path, 'u.json "=a.* / b.*"')
    with pytest.raises(results.DocsError, match="one '\\*' a key"):  # not the diagonal of rows x s
        values.render_bench_range(tmp_path, 's.json "=rows.*.s.* * 1"')
    assert values.render_bench_value(tmp_path, 'u.json "=x * 2.*3"') == "3"  # a number's '.*' is multiplication
    with pytest.raises(results.DocsError, match="'one' is not a list"):
        values.render_bench_range(tmp_path, "s.json one.*")
    assert values.render_bench_value(tmp_path, 'n.json "=-(runs.0.p.0.x - 1)"') == "0"  # not "−0"
    with pytest.raises(results.DocsError, match="is inf"):
        values.render_bench_value(tmp_path, "n.json inf")
    assert values.render_bench_value(tmp_path, 'b.json "=-(pairs.0.z + pairs.2.z) / 2"') == "\u22122.75"
    assert values.render_bench_range(tmp_path, "a.json x b.json x") == "0.25 to 0.50"
    assert values.render_bench_range(tmp_path, "a.json x b.json x a.json x %") == "25.0 to 50.0 %"
    assert values.render_bench_range(tmp_path, 'a.json "=x * y" b.json "=(y - x) / y"') == "0.94 to 1.00"
    assert values.render_bench_range(tmp_path, "a.json y b.json y") == "2 to 4"  # counts read as counts
    assert values.render_bench_range(tmp_path, "a.json x none.json x") == "*pending*"
    assert values.render_bench_value(tmp_path, 'a.json "s.compl tok/s.dev"') == "12"
    assert values.render_bench_ratio(tmp_path, 'a.json "=y + y" b.json y') == "1.00×"
    value, range_ = values.render_bench_value, values.render_bench_range
    for render, bad, message in ((range_, "a.json", "bench-range: expected"), (range_, "a.json y.*.z", "not a list"),
                                 (range_, "a.json x b.json x furlongs", "bench-range: expected"),
                                 (range_, 'a.json "=x ** y" b.json x', "only"),
                                 (range_, 'a.json "=x +" b.json x', "not an expression"),
                                 (range_, 'a.json "=x / (y - 2)" b.json x', "divides by zero"),
                                 (value, 'a.json "=x * 1e308 * 10"', "is inf"),
                                 (value, 'a.json "x', "bench-value: No closing quotation")):
        with pytest.raises(results.DocsError, match=message):
            render(tmp_path, bad)


def test_bench_median_over_a_lists_items(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"pairs": [{"z": 3.5}, {"z": -1.5}, {"z": 2}]}))
    assert values.render_bench_median(tmp_path, "r.json pairs.*.z") == "2"  # a count reads as one
    assert values.render_bench_median(tmp_path, "r.json pairs.1.z r.json pairs.1.z") == "\u22121.50"
    assert values.render_bench_median(tmp_path, "r.json pairs.*.z %") == "200.0 %"
    assert values.render_bench_median(tmp_path, "none.json pairs.*.z") == "*pending*"
    with pytest.raises(results.DocsError, match="bench-median: expected"):
        values.render_bench_median(tmp_path, "r.json")


def test_bench_count_counts_a_lists_items_that_pass(tmp_path: Path) -> None:
    """'7 of 10' comes from the file: against a number, or against another file's median."""
    (tmp_path / "r.json").write_text(json.dumps({"pairs": [{"z": 3.5, "w": 1}, {"z": -1.5, "w": 0}, {"z": 2, "w": 3}]}))
    (tmp_path / "o.json").write_text(json.dumps({"pairs": [{"z": 0}, {"z": 2.5}, {"z": 9}]}))
    count = values.render_bench_count
    assert count(tmp_path, "r.json pairs.*.z > 0") == "2 of 3"
    assert count(tmp_path, "r.json pairs.*.z >= 2") == "2 of 3"
    assert count(tmp_path, "r.json pairs.*.z < o.json pairs.*.z") == "2 of 3"  # under o's median, 2.5
    assert count(tmp_path, 'r.json "=pairs.*.z - pairs.*.w" > -1.2') == "2 of 3"  # each item's own difference: 2.5, -1.5, -1
    assert count(tmp_path, "none.json pairs.*.z > 0") == "*pending*"
    for bad, message in (("r.json pairs.0.z > 0", "expected"), ("r.json pairs.*.z == 0", "expected"),
                         ("r.json pairs.*.z > ten", "not a finite number"), ("r.json pairs.*.z > nan", "not a finite"),
                         ('r.json "=pairs.0.z * 2" > 0', "expected"), ("r.json pairs.*.z > 10 %", "no fifth word"),
                         ("none.json pairs.*.z > ten", "not a finite number")):
        with pytest.raises(results.DocsError, match=message):
            count(tmp_path, bad)
    assert "2 of 3 pairs" in hook.expand("<!-- bench-count: r.json pairs.*.z > 0 --> pairs", tmp_path)
