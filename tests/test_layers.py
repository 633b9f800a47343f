"""The package's import graph (ARCHITECTURE.md, "The layers"): no import runs back up a layer,
and no two modules import each other, directly or round a longer circle.

Every ``import`` counts: at the top of a module, inside a function, under ``TYPE_CHECKING``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import course_pkg

ROOT = Path(course_pkg.__file__).parent

#: Lower layers first. A module may import its own layer and the ones below, never one above.
LAYERS = [
    {"validation", "sampling_params"},
    {"block", "sequence"},
    {"free_block_queue"},
    {"block_manager", "kv_cache_spec"},
    {"swap", "radix_tree", "foils", "undo", "beam_search", "offload", "hybrid_block_manager"},
    {"policies"},
    {"scheduler"},
    {"kernels", "models", "distributed"},
    {"engine"},
    {"viz", "workloads", "serve", "labs"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from course_pkg.x import y`` counts as x.y
    when x/y is a module, else as x)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name and target.startswith("course_pkg"):
                    graph[name].add(target)
    return graph


def layer(module: str) -> int:
    if module == "course_pkg":   # the public API re-exports every layer: it sits with the top one
        return len(LAYERS) - 1
    top = module.split(".")[1]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    return len(LAYERS)


def test_every_module_has_a_layer():
    assert [m for m in imports() if layer(m) == len(LAYERS)] == []


def test_no_import_runs_back_up_a_layer():
    graph = imports()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer(t) > layer(m))
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = imports()
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_check_sees_imports_inside_functions_and_under_type_checking():
    graph = imports()   # (both kinds exist in the package: the check would miss cycles otherwise)
    assert "course_pkg.engine.llm_engine" in graph["course_pkg.engine.async_llm"]   # inside __init__
    assert "course_pkg.models" in graph["course_pkg.engine.llm_engine"]               # inside __init__
