"""The package's import structure, read from the source (every import statement, function-local
ones included, and those under `if TYPE_CHECKING:`): no import cycle anywhere in `cutedsl/`, runtime code never imports the tools or
the benchmarks, and each backend package is self-contained (sm90 and sm100 never import each
other or the public runners)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cutedsl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The cutedsl modules `name` imports (a `from pkg import x` names pkg.x when it is a module)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_whole_package() -> None:
    assert {"cutedsl.runner", "cutedsl.sm90.runners", "cutedsl.sm100.runners"} <= set(MODULES)
    assert "cutedsl.sm90.runners" in GRAPH["cutedsl.linear"]  # the explicit backend table
    assert "cutedsl.jit" in GRAPH["cutedsl.sm90.gemm"]


def test_no_import_cycle() -> None:
    assert _cycles() == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a two-module loop added to the graph is reported."""
    GRAPH["cutedsl.formats"].add("cutedsl.linear")
    try:
        assert any("cutedsl.formats" in c and "cutedsl.linear" in c for c in _cycles())
    finally:
        GRAPH["cutedsl.formats"].discard("cutedsl.linear")


def _under(name: str, *pkgs: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in pkgs)


def test_runtime_code_never_imports_tools_or_bench() -> None:
    bad = [
        (m, d)
        for m, deps in GRAPH.items()
        if not _under(m, "cutedsl.tools", "cutedsl.bench")
        for d in deps
        if _under(d, "cutedsl.tools", "cutedsl.bench")
    ]
    assert bad == []


def test_backends_are_self_contained() -> None:
    """A backend imports the shared core (formats, jit, validate, workspace, kernels helpers), never
    the other backend, the public runners, the vLLM adapters, the tools or the benchmarks."""
    public = {"cutedsl.linear", "cutedsl.grouped_oproj", "cutedsl.shared_mlp", "cutedsl.moe"}
    for mine, other in (("cutedsl.sm90", "cutedsl.sm100"), ("cutedsl.sm100", "cutedsl.sm90")):
        for m, deps in GRAPH.items():
            if not _under(m, mine):
                continue
            for d in deps:
                assert not _under(d, other, "cutedsl.vllm", "cutedsl.tools", "cutedsl.bench"), (
                    m,
                    d,
                )
                assert d not in public | {"cutedsl.runner", "cutedsl.ops"}, (m, d)
