"""The package layout the architecture promises: the algorithm does no I/O, and no module imports in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALGORITHM = ROOT / "packages/trainer/src/agl_trainer/algorithm"
#: what the algorithm may import: pure standard modules, torch, the record schemas, its own modules
PURE = {"__future__", "collections", "collections.abc", "dataclasses", "typing", "math", "statistics", "random",
        "zlib", "torch", "agl_common.schemas"}
#: calls and attributes that read or write the world
IO_NAMES = {"open", "print", "input", "exec", "eval", "__import__"}
#: (clients' calls need an import or an ``await``, both caught; these catch files handed in as paths)
IO_ATTRS = {"read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "rename", "glob", "iterdir",
            "touch", "rmdir"}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def io_faults(path: Path) -> list[str]:
    """What in ``path`` is not pure: imports outside :data:`PURE`, file/network/process calls."""
    tree = ast.parse(path.read_text())
    annotations = _type_checking_only(tree)
    faults = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in annotations:
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # a sibling: checked on its own
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            faults += [f"{path.name}:{node.lineno} imports {n}" for n in names if n not in PURE]
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in IO_NAMES:
                faults.append(f"{path.name}:{node.lineno} calls {fn.id}()")
            if isinstance(fn, ast.Attribute) and fn.attr in IO_ATTRS:
                faults.append(f"{path.name}:{node.lineno} calls .{fn.attr}()")
        elif isinstance(node, ast.Await):
            faults.append(f"{path.name}:{node.lineno} awaits (I/O happens outside the algorithm)")
    return faults


def test_the_algorithm_does_no_io():
    modules = sorted(ALGORITHM.glob("*.py"))
    assert {p.stem for p in modules} >= {"advantage", "aggregate", "batch", "loss", "minibatch", "evalstats",
                                          "stepstats"}
    assert [f for p in modules for f in io_faults(p)] == []


def test_the_io_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import redis\nfrom pathlib import Path\n\nasync def f(store):\n"
                   "    Path('x').write_text('y')\n    return await store.read_calls('r')\n")
    faults = io_faults(bad)
    assert any("imports redis" in f for f in faults) and any("imports pathlib" in f for f in faults)
    assert any(".write_text" in f for f in faults) and any("awaits" in f for f in faults)


SRC = [ROOT / "packages" / p / "src" for p in ("common", "gateway", "controller", "trainer")]


def module_graph() -> dict[str, set[str]]:
    """``module -> the agl modules it imports at import time`` (module level, outside ``TYPE_CHECKING``;
    imports inside functions run later and cannot form an import cycle)."""
    files = {".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f
             for src in SRC for f in src.rglob("*.py") if "egg-info" not in str(f)}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        tree = ast.parse(f.read_text())
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                deps |= {base} | {f"{base}.{a.name}" for a in node.names}
        # a module's own packages are always imported before it: not an edge
        graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles in ``graph`` (each as the path that closes it)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_no_import_cycles():
    graph = module_graph()
    assert "agl_trainer.algorithm.batch" in graph and "agl_trainer.loop" in graph
    assert cycles(graph) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
