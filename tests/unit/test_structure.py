"""The package's shape stays as docs/architecture.md draws it: no module over 450 lines (package and
scripts/), `sglang.srt` imported at module level only by the integration layer (and the CPU attention
backend, which subclasses SGLang's; documented there), and no import cycle between our modules of
any kind: at module level, inside functions, under TYPE_CHECKING, through importlib, or through a
package's __init__ (a cycle hidden in a function is still two modules that cannot be read or tested
apart)."""

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
        if anywhere and isinstance(node, ast.Call) and _dynamic_import(node):
            found.append(node.args[0].value)  # type: ignore[attr-defined]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]
    return found


def _dynamic_import(node: ast.Call) -> bool:
    """`importlib.import_module("x")` or `__import__("x")` with a literal absolute name."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    arg = node.args[0] if node.args else None
    return (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
            and isinstance(arg.value, str) and not arg.value.startswith("."))


def _with_packages(imported: str, mods: dict[str, Path]) -> list[str]:
    """An import of a.b.c runs a/__init__ and a/b/__init__ first: those are edges too."""
    parts = imported.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods]


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
    return {name: {dep for imp in _imports(name, path, anywhere=anywhere) for dep in _with_packages(imp, mods)
                   if dep != name and not name.startswith(dep + ".")}
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


def test_the_graph_sees_package_inits_and_dynamic_imports(tmp_path: Path) -> None:
    """A cycle through a package's __init__ (importing pkg.mod runs pkg/__init__ first) or through
    importlib is still a cycle."""
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    import importlib\n    importlib.import_module('superinfer_sgl.integration.runtime')\n"
                   "    __import__('superinfer_sgl.rotasched.lvf', fromlist=['x'])\n")
    found = {d for imp in _imports("superinfer_sgl.m", mod, anywhere=True) for d in _with_packages(imp, _modules())}
    assert {"superinfer_sgl.integration", "superinfer_sgl.integration.runtime", "superinfer_sgl.rotasched",
            "superinfer_sgl.rotasched.lvf"} <= found
    assert not _imports("superinfer_sgl.m", mod, anywhere=False)  # none at module level


def test_cycle_finder_sees_a_cycle_through_a_function_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _top_level_imports(name: str, path: Path) -> list[str]:
    return _imports(name, path, anywhere=False)


def test_the_reading_path_names_each_integration_module_once() -> None:
    """docs/architecture.md's reading path: every module of the layer that touches SGLang, once."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    path = doc[doc.index("## Reading path"):doc.index("## The hooks")]
    counts = {p.name: path.count(f"`integration/{p.name}`") for p in (PKG / "integration").glob("*.py")
              if p.name != "__init__.py"}
    assert all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n != 1}
