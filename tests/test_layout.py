"""The house's layout: `common/` in three rooms, imports going downwards only.

Why: `common/` holds the engine's parts every stage imports (its root), the measuring kit
(`common/bench/`) and the HTTP layer (`common/serve/`). A reader who opens a module should be
able to tell what it may depend on, and a change to the bench flags should not reach the model.
So every import in `common` (at the top of a module or inside a function, since a lazy import is
still a dependency) is read with `ast`, and the graph must have no circle, no room may import
one above it (root <- bench <- serve <- cli), and a stage may import only the engine's parts and
the harness's one entry.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The `common` modules `path` imports, wherever in it the import stands."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from common.bench import flags`
    return {m for m in found if m in known and m != name}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    paths = sorted((root / "common").rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    return {module_name(p, root): imports_of(p, known, root) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def room(module: str) -> int:
    """0: the engine's parts; 1: the measuring kit; 2: the HTTP layer; 3: the one entry point."""
    if module == "common.cli":
        return 3
    if module.startswith("common.serve"):
        return 2
    if module.startswith("common.bench"):
        return 1
    return 0


def test_the_walk_sees_every_kind_of_import_and_finds_a_circle(tmp_path: Path) -> None:
    """The checks below are only as good as this walk: relative, lazy and `from package import
    module` imports must all count, and a circle through three modules must be found."""
    files = {"common/__init__.py": "", "common/config.py": "", "common/model.py": "from .config import X\n",
             "common/bench/__init__.py": "", "common/bench/flags.py": "",
             "common/bench/harness.py": "def f():\n    from common.bench import flags\n    import common.model\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path)
    assert edges["common.model"] == {"common.config"}
    assert edges["common.bench.harness"] == {"common.bench", "common.bench.flags", "common.model"}
    assert cycles(edges) == []
    (tmp_path / "common/config.py").write_text("import common.bench.harness\n")
    assert cycles(graph(tmp_path)) == [["common.bench.harness", "common.config", "common.model"]]


def test_the_walk_reads_relative_and_lazy_imports() -> None:
    edges = graph()
    assert "common.config" in edges["common.model"]  # `from .config import ModelConfig`
    assert "common.bench.spawn" in edges["common.bench.harness"]  # imported inside run_stage_bench
    assert "common.bench.streaming" in edges["common.bench.child"]  # `from common.bench import streaming`


def test_no_import_circle_in_common() -> None:
    assert cycles(graph()) == []


def test_each_room_imports_downwards_only() -> None:
    upward = [(m, d) for m, deps in graph().items() for d in deps if room(d) > room(m)]
    assert upward == []


def test_the_child_process_never_imports_what_spawns_it() -> None:
    """`python -m common.bench.child` runs one engine; the parents that start it (the harness, the
    ladder, spawn) must not be among its imports, directly or through another module."""
    edges = graph()
    seen, todo = set(), ["common.bench.child"]
    while todo:
        for dep in edges[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert seen.isdisjoint({"common.bench.spawn", "common.bench.harness", "common.bench.ladder", "common.cli"})


@pytest.mark.parametrize("stage", sorted(p.name for p in (ROOT / "stages").glob("s[0-9]*_*")))
def test_a_stage_imports_the_engine_parts_and_the_harness_only(stage: str) -> None:
    known = {module_name(p) for p in (ROOT / "common").rglob("*.py")}
    used = set()
    for path in (ROOT / "stages" / stage).glob("*.py"):
        if path.name.startswith("test_"):
            continue  # a stage's tests may use the measuring kit
        used |= imports_of(path, known)
    assert {m for m in used if room(m) > 0} <= {"common.bench", "common.bench.harness"}


def test_every_name_common_re_exports_resolves() -> None:
    """`common.percentiles` pointed at a module that had moved into `common/bench/`: the lazy export
    failed only when a reader used it. And the root re-exports only the root's own modules."""
    import common

    for name, module in common._EXPORTS.items():
        assert module.count(".") == 1, (name, module)  # common.<module>: the root, not bench/ or serve/
        assert getattr(common, name) is getattr(__import__(module, fromlist=[name]), name)
