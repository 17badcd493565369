"""The import rules of the layout (README "Layout"), checked on the package's source: imports point one
way, from the edges inward, and no module imports itself back through others.

Every `import` / `from ... import` counts, at module level or inside a function: a deferred import is
still a dependency, it only hides the circle until the first call.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"

# area (the first folder under posttrain/) -> the areas it must not import
FORBIDDEN = {
    "models": {"engine", "trainers", "quant", "eval", "rollout", "serve", "peft", "distributed"},
    "kernels": "everything",
    "algos": "everything",
    "engine": {"trainers", "rollout", "eval", "serve"},
    "eval": {"trainers"},
    "rewards": {"trainers"},
    "envs": {"trainers"},
}
# Top-level modules that import nothing of ours: every area may use them, the leaf areas above included.
LEAVES = {"cache"}


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The posttrain modules `name` imports, each resolved to the deepest module that exists."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """`module -> dependency` for every import against FORBIDDEN (imports within one area are free)."""
    broken = []
    for module, deps in sorted(graph.items()):
        forbidden = FORBIDDEN.get(area(module))
        for dep in sorted(deps):
            if forbidden is None or area(dep) == area(module) or area(dep) in LEAVES:
                continue
            if forbidden == "everything" or area(dep) in forbidden:
                broken.append(f"{module} -> {dep}")
    return broken


def test_leaves_import_nothing_of_ours():
    graph = import_graph()
    for leaf in LEAVES:
        assert not graph[f"posttrain.{leaf}"], f"posttrain.{leaf} imports {sorted(graph[f'posttrain.{leaf}'])}"


def test_models_keep_no_per_thread_state():
    """Plans, staging buffers and scratch tensors belong to the engine's runner, handed to the attention through
    PagedAttentionMetadata: state in models/ would be shared by every engine of a thread."""
    holders = [path.name for path in (PACKAGE / "models").rglob("*.py") if "threading.local" in path.read_text()]
    assert not holders, f"threading.local in models/: {holders}"


def test_imports_point_inward():
    broken = broken_rules(import_graph())
    assert not broken, "imports against the layout's direction:\n" + "\n".join(broken)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: the graph is a few hundred nodes deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_no_import_circles():
    circles = strongly_connected(import_graph())
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_checker_sees_a_circle_and_a_wrong_direction():
    graph = {"posttrain.a.x": {"posttrain.b.y"}, "posttrain.b.y": {"posttrain.a.x"}, "posttrain.c": set()}
    assert strongly_connected(graph) == [["posttrain.a.x", "posttrain.b.y"]]
    graph = {
        "posttrain.models.hub": {"posttrain.quant.io", "posttrain.models.config"},
        "posttrain.algos.kl": {"posttrain.errors"},
        "posttrain.trainers.sft": {"posttrain.models.hub"},
    }
    assert broken_rules(graph) == [
        "posttrain.algos.kl -> posttrain.errors",
        "posttrain.models.hub -> posttrain.quant.io",
    ]
    known = module_files()
    assert "posttrain.models.transformer" in imported_modules(
        "posttrain.models.hub", known["posttrain.models.hub"], known
    )
