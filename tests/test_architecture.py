"""The layering of the package: no import cycles between its parts.

Parts are the top-level modules and subpackages of ``acoll`` (``_coll``, ``_comm``,
``_transport``, ``_memory``, ``_dtypes``, ...). Every import statement counts, including
those inside functions and under ``TYPE_CHECKING``: a cycle hidden in a function is still
a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "acoll"


def _part(module: str) -> str | None:
    """``acoll._coll.base`` -> ``_coll``; modules outside acoll -> None."""
    bits = module.split(".")
    if bits[0] != "acoll" or len(bits) < 2:
        return None
    return bits[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            for alias in node.names:  # "from . import x" imports module x
                out.add(f"{target}.{alias.name}")
    return out


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        src = _part(_module_name(path))
        if src is None:  # acoll/__init__.py: the facade imports everything
            continue
        for target in _imports(path):
            dst = _part(target)
            if dst is None or dst == src:
                continue
            if (SRC / dst).is_dir() or (SRC / f"{dst}.py").exists():
                graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles_between_parts() -> None:
    graph = part_graph()
    assert "_coll" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_algorithms_see_a_narrow_interface() -> None:
    """Collective algorithms know memory spaces and connections, not the communicator
    nor NumPy."""
    graph = part_graph()
    assert "_communicator" not in graph["_coll"]
    assert "_comm" not in graph["_coll"]
    for path in (SRC / "_coll").glob("*.py"):
        assert "numpy" not in _imports(path), path.name


@pytest.mark.parametrize("part", ["_memory", "_transport", "_topology"])
def test_lower_layers_do_not_reach_up(part: str) -> None:
    graph = part_graph()
    assert not graph.get(part, set()) & {"_coll", "_comm", "_communicator"}, graph.get(part)
