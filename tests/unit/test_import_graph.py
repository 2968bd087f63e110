"""The import graph of ``lightning_moe``: imports point down the layers of ``docs/architecture.md``,
and no modules import each other in a loop.

Every ``import`` statement of a module counts: at module level, inside functions, and under
``if TYPE_CHECKING:``. A lazy import is still a dependency (it only moves the failure to run
time), and an annotation-only import ties the modules in meaning: both count for the layers and
for circles. The code is read with ``ast``; nothing of the package is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_moe"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# The layers, lowest first, as docs/architecture.md declares them. A module may import its own layer
# and the layers below it. Keys are the first name under lightning_moe/: a file or a folder
# (a folder's modules all share its layer); "__init__" is the package itself.
LAYER_NAMES = ("ground", "ops", "moe", "parallel", "models", "checkpoint", "training", "entry points")
LAYERS: dict[str, int] = {
    "checks": 0,
    "config": 0,
    "data": 0,
    "metrics": 0,
    "optimizer": 0,
    "resources": 0,
    "ops": 1,
    "moe": 2,
    "parallel": 3,
    "models": 4,
    "checkpoint": 5,
    "callbacks": 6,
    "lit": 6,
    "lit_hf": 6,
    "strategies": 6,
    "__init__": 7,  # importing the package registers the strategy names
    "cli": 7,
    "export": 7,
    "generate": 7,
}
LIGHTNING_FREE = ("ops", "moe", "parallel", "models")

# Upward imports allowed for now: (importer, imported) -> the name other modules still import from
# the importer, which is why the edge exists. Each entry is checked to be still needed, so this
# list only shrinks; delete an entry with the import it allows.
_KNOWN: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    """The key of ``LAYERS`` a module falls under."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The package modules ``node`` loads by name: for ``from a import b`` the module ``a.b`` where
    it is one, else ``a``; a dotted name that is no module falls back to its longest module prefix."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            anchor = package[: len(package) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def _graph() -> dict[str, dict[str, int]]:
    """``{importer: {imported: first line}}`` over every module of the package, self-imports left out."""
    known = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported_modules(node, module, path.name == "__init__.py", known):
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _upward(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    return {
        (src, dst): line
        for src, edges in graph.items()
        for dst, line in edges.items()
        if LAYERS.get(_unit(dst), -1) > LAYERS.get(_unit(src), len(LAYER_NAMES))
    }


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
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
                    work.append((child, iter(graph[child])))
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
                    out.append(sorted(component))
    return out


def _without_known(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {src: {dst: line for dst, line in edges.items() if (src, dst) not in _KNOWN} for src, edges in graph.items()}


def _where(module: str) -> str:
    return str(_modules()[module].relative_to(ROOT))


def test_every_module_belongs_to_a_declared_layer() -> None:
    missing = sorted({_unit(m) for m in _modules()} - set(LAYERS))
    assert not missing, (
        f"lightning_moe/{missing} belong to no layer: add each to LAYERS in this test and to the layer it "
        "joins in docs/architecture.md."
    )
    assert set(LAYERS.values()) == set(range(len(LAYER_NAMES)))


def test_architecture_doc_names_every_layer_and_its_modules() -> None:
    text = ARCHITECTURE.read_text()
    for unit in LAYERS:
        if unit == "__init__":
            continue
        named = f"`{unit}/`" in text or f"`{unit}.py`" in text
        assert named, f"docs/architecture.md does not name `{unit}/` or `{unit}.py` in its layer."
    for name in LAYER_NAMES:
        assert f"## {name}" in text.lower(), f"docs/architecture.md has no section '## {name}'."


def test_no_module_imports_from_a_higher_layer() -> None:
    found = {edge: line for edge, line in _upward(_graph()).items() if edge not in _KNOWN}
    lines = [
        f"{_where(src)}:{line} imports {dst} ({LAYER_NAMES[LAYERS[_unit(src)]]} -> {LAYER_NAMES[LAYERS[_unit(dst)]]})"
        for (src, dst), line in sorted(found.items())
    ]
    assert not lines, "imports that run up the layers; move the code down or pass it in:\n" + "\n".join(lines)


def test_no_modules_import_each_other_in_a_loop() -> None:
    graph = _without_known(_graph())
    lines = []
    for component in _circles(graph):
        members = set(component)
        ties = [f"{_where(src)}:{graph[src][dst]} -> {dst}" for src in component for dst in graph[src] if dst in members]
        lines.append(" | ".join(ties))
    assert not lines, "modules that import each other (a circle each line):\n" + "\n".join(lines)


def test_known_exceptions_are_still_needed() -> None:
    graph = _graph()
    upward = _upward(graph)
    importers_of: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    importers_of[(node.module, alias.name)].append(module)
    for (src, dst), name in _KNOWN.items():
        assert (src, dst) in upward, f"{src} no longer imports {dst} upward: delete its _KNOWN entry."
        callers = [m for m in importers_of[(src, name)] if m != src]
        assert callers, f"no module imports {name} from {src} any more: delete it there, its import of {dst}, and its _KNOWN entry."


def test_lower_layers_do_not_import_lightning() -> None:
    found = []
    for module, path in _modules().items():
        if _unit(module) not in LIGHTNING_FREE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{_where(module)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not found, f"{'/, '.join(LIGHTNING_FREE)}/ are plain PyTorch; pass what they need in instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("graph", "circles"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, []),
        ({"a": {"b": 1}, "b": {"a": 1}, "c": {"a": 1}}, [["a", "b"]]),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {"d": 1}}, [["a", "b", "c"]]),
    ],
)
def test_circle_finder_on_small_graphs(graph: dict[str, dict[str, int]], circles: list[list[str]]) -> None:
    assert sorted(_circles(graph)) == circles
