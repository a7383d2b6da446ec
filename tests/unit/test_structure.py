"""The package's shape stays as docs/architecture.md draws it (issue 15): no module over 450 lines,
`sglang.srt` imported at module level only by the integration layer (and the CPU attention
backend, which subclasses SGLang's; documented there), and no import cycle between our modules."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "superinfer_sgl"
MAX_LINES = 450
SGLANG_ALLOWED = ("integration/", "cpu_attention/backend.py")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _top_level_imports(name: str, path: Path) -> list[str]:
    """Modules imported by the module body itself (not inside functions: those run late)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in tree.body:
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
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_only_the_integration_layer_imports_sglang_srt_at_module_level() -> None:
    offenders = []
    for name, path in _modules().items():
        rel = str(path.relative_to(PKG))
        if any(imp.startswith("sglang.srt") for imp in _top_level_imports(name, path)):
            if not rel.startswith(SGLANG_ALLOWED):
                offenders.append(rel)
    assert not offenders, offenders


def test_no_import_cycle_between_our_modules() -> None:
    mods = _modules()
    # A module's own ancestor packages are not edges: Python runs a package's __init__ before any
    # of its submodules either way, and `from pkg import sub` inside pkg is the usual layout.
    graph = {name: sorted({imp for imp in _top_level_imports(name, path)
                           if imp in mods and imp != name and not name.startswith(imp + ".")})
             for name, path in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
