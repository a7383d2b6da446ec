"""The package's shape stays as docs/architecture.md draws it: no module over 450 lines (package and
scripts/), `sglang.srt` imported at module level only by the integration layer (and the CPU attention
backend, which subclasses SGLang's; documented there), and no import cycle between our modules of
any kind: at module level, inside functions, or under TYPE_CHECKING (a cycle hidden in a function
is still two modules that cannot be read or tested apart)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "superinfer_sgl"
MAX_LINES = 450
SGLANG_ALLOWED = ("integration/", "cpu_attention/backend.py")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, *, anywhere: bool) -> list[str]:
    """Modules `name` imports: in its module body only, or `anywhere` (functions, TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in (ast.walk(tree) if anywhere else tree.body):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]
    return found


def test_no_module_is_over_450_lines() -> None:
    files = [*PKG.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_only_the_integration_layer_imports_sglang_srt_at_module_level() -> None:
    offenders = []
    for name, path in _modules().items():
        rel = str(path.relative_to(PKG))
        if any(imp.startswith("sglang.srt") for imp in _top_level_imports(name, path)):
            if not rel.startswith(SGLANG_ALLOWED):
                offenders.append(rel)
    assert not offenders, offenders


def _import_graph(*, anywhere: bool) -> dict[str, set[str]]:
    mods = _modules()
    # A module's own ancestor packages are not edges: Python runs a package's __init__ before any
    # of its submodules either way, and `from pkg import sub` inside pkg is the usual layout.
    return {name: {imp for imp in _imports(name, path, anywhere=anywhere)
                   if imp in mods and imp != name and not name.startswith(imp + ".")}
            for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach one another (strongly connected, more than one module)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        reach[start] = seen
    groups = {frozenset({a} | {b for b in reach[a] if a in reach[b]}) for a in graph if a in reach[a]}
    return sorted(sorted(g) for g in groups)


def test_no_import_cycle_at_module_level() -> None:
    assert not _cycles(_import_graph(anywhere=False))


def test_no_import_cycle_of_any_kind() -> None:
    """Imports inside functions and under TYPE_CHECKING count too."""
    assert not _cycles(_import_graph(anywhere=True))


def test_cycle_finder_sees_a_cycle_through_a_function_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _top_level_imports(name: str, path: Path) -> list[str]:
    return _imports(name, path, anywhere=False)
