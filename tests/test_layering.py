"""Import layering, read from the source (every import statement, also those inside functions,
but not those under `if TYPE_CHECKING:`):
the runtime package never imports the tools, and no module of cutedsl imports itself back through
a chain of imports (no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "cutedsl"
TOOLING = ("cutedsl.tools", "cutedsl.bench")  # may import the runtime, never the reverse


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The cutedsl module `name` refers to (a module, or the package holding a name)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node but the bodies of `if TYPE_CHECKING:` (never executed, so no import cycle)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(mod: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            r = _resolve(n) if n.startswith("cutedsl") else None
            if r is not None and r != mod:
                found.add(r)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _is_tooling(mod: str) -> bool:
    return any(mod == t or mod.startswith(t + ".") for t in TOOLING)


def test_runtime_never_imports_the_tools() -> None:
    bad = sorted(
        (m, d)
        for m, deps in GRAPH.items()
        if not _is_tooling(m)
        for d in deps
        if d == "cutedsl.tools" or d.startswith("cutedsl.tools.")
    )
    assert not bad, bad


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start through `graph`, or None."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for d in sorted(graph.get(node, ())):
            if d == start:
                return [*path, d]
            if d not in seen:
                seen.add(d)
                stack.append((d, [*path, d]))
    return None


def test_no_import_cycle_in_the_tools() -> None:
    tools = {m: deps for m, deps in GRAPH.items() if m.startswith("cutedsl.tools")}
    assert "cutedsl.tools.quantize" in tools and "cutedsl.tools.tiny_model" in tools
    for m in sorted(tools):
        cyc = _cycle_from(m, GRAPH)
        assert cyc is None, " -> ".join(cyc)


def test_no_import_cycle_anywhere() -> None:
    # A package's __init__ importing its own submodules is not a cycle to report: the edge
    # submodule -> package is only the parent package being imported first.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in GRAPH.items()}
    cycles = {}
    for m in sorted(graph):
        cyc = _cycle_from(m, graph)
        if cyc is not None:
            cycles[frozenset(cyc)] = " -> ".join(cyc)
    assert not cycles, sorted(cycles.values())


def test_the_checker_sees_a_cycle_and_a_tools_import() -> None:
    """The checks can fail: a made-up cycle and a made-up runtime -> tools import are found."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from("a", g) == ["a", "b", "c", "a"] and _cycle_from("d", g) is None
    src = PKG / "tools" / "quantize.py"
    assert "cutedsl.tools.checkpoint" in _imports("cutedsl.tools.quantize", src)
    assert "cutedsl.names" in GRAPH["cutedsl.vllm.names"]
