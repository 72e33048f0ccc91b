"""The import graph of `api`, `models_app` and `mlxhost`: no cycles, and the layers keep their side.

The graph is read with `ast`, not by importing: every `import` counts, function-local ones too
(they hide a cycle from Python but not from a reader), except those under `if TYPE_CHECKING:`,
which never run. An edge goes to the module named (`from a.b import c` is `a.b.c` when that is a
module, else `a.b`); executing a parent package's `__init__` does not count as an edge.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "models_app", "mlxhost")
# The engine's internals; `api/` goes through `mlxhost.engine`'s public names (issue 11, item 4).
ENGINE_PRIVATE = ("mlxhost.engine.instance", "mlxhost.engine.registry", "mlxhost.engine.lane")


@dataclass(frozen=True, slots=True)
class Import:
    source: str
    target: str
    line: int
    kind: str  # "module" (runs at import), "local" (inside a function) or "type_checking"


@dataclass(slots=True)
class Graph:
    modules: set[str] = field(default_factory=set)
    imports: list[Import] = field(default_factory=list)

    def edges(self, *, type_checking: bool = False) -> dict[str, set[str]]:
        """Module -> the modules it imports, counting function-local imports, and TYPE_CHECKING
        ones only when asked."""
        out: dict[str, set[str]] = {module: set() for module in self.modules}
        for item in self.imports:
            if type_checking or item.kind != "type_checking":
                out[item.source].add(item.target)
        return out

    def count(self, kind: str) -> int:
        return sum(1 for item in self.imports if item.kind == kind)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, "local" if kind == "module" else kind)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), kind)
        else:
            yield from _walk(child, kind)


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = source.split(".") if is_package else source.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    for alias in node.names:
        yield f"{base}.{alias.name}"  # resolved to `base` below when it names no module


def _resolve(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def build_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> Graph:
    """Read every module under `packages` (below `root`) and the imports between them."""
    graph = Graph()
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    graph.modules = set(files)
    for source, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, kind in _walk(tree, "module"):
            for name in _targets(node, source, is_package):
                target = _resolve(name, graph.modules)
                if target is not None and target != source:
                    graph.imports.append(Import(source, target, node.lineno, kind))
    return graph


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return [_cycle_in(component, edges) for component in components]


def _cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    start = min(component)
    # Breadth-first from start back to start inside the component: the shortest cycle through it.
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _describe(cycle: list[str], graph: Graph) -> str:
    steps = []
    for source, target in itertools.pairwise(cycle):
        _, line, kind = min(  # an import that runs first, when there is one
            (i.kind == "type_checking", i.line, i.kind)
            for i in graph.imports
            if i.source == source and i.target == target
        )
        steps.append(f"{source} -> {target} (line {line}, {kind})")
    return "\n  ".join(steps)


# The project ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


def test_no_import_cycle_between_modules(graph: Graph) -> None:
    """Issue 11: no cycle among api/, models_app/ and mlxhost/, counting function-local imports."""
    cycles = find_cycles(graph.edges())
    report = "\n".join(f"cycle:\n  {_describe(cycle, graph)}" for cycle in cycles)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) ({graph.count('module')} module-level, {graph.count('local')} "
        f"function-local imports counted; {graph.count('type_checking')} TYPE_CHECKING ones not):\n{report}"
    )


def test_models_app_has_no_import_cycle_even_for_types(graph: Graph) -> None:
    """Issue 26: inside `models_app` no cycle at all, TYPE_CHECKING imports counted too. A type
    that two modules share lives below both (`KeyIdentity` in `accounting/identity.py`, not in
    `catalogue/selectors.py`, which imports `control`, which imports `hotcache`, which caches it)."""
    edges = {
        module: {target for target in targets if target.split(".")[0] == "models_app"}
        for module, targets in graph.edges(type_checking=True).items()
        if module.split(".")[0] == "models_app"
    }
    cycles = find_cycles(edges)
    report = "\n".join(f"cycle:\n  {_describe(cycle, graph)}" for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) in models_app:\n{report}"


def test_a_type_checking_import_closes_a_cycle_when_asked(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        },
    )
    assert find_cycles(graph.edges()) == []
    assert find_cycles(graph.edges(type_checking=True)) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert "pkg.b -> pkg.a (line 3, type_checking)" in _describe(["pkg.a", "pkg.b", "pkg.a"], graph)


def test_api_and_models_app_never_import_engine_internals(graph: Graph) -> None:
    """Issue 11: `api/` and `models_app/` use `mlxhost.engine`'s public names, never its instance,
    registry or lane."""
    bad = [
        f"{item.source}:{item.line} imports {item.target} ({item.kind})"
        for item in graph.imports
        if item.source.split(".")[0] in ("api", "models_app") and item.target.startswith(ENGINE_PRIVATE)
    ]
    assert not bad, "\n".join(bad)


# Offline tools that build model folders (the tiny test model, the demo's GGUF conversion, the
# demo embedding model's unpacking, quantized copies made by a Celery task).
ENGINE_TOOLS = (
    "mlxhost.engine.backends.mlx.tiny",
    "mlxhost.engine.backends.mlx.quantize",
    "mlxhost.engine.backends.mlx.gguf",
    "mlxhost.engine.backends.mlx.minilm",
)


def test_outside_the_engine_only_its_public_names_are_imported(graph: Graph) -> None:
    """Issue 11: `api/`, `models_app/` and the runtime import `mlxhost.engine` itself (its
    `__all__`), never a module inside it; the management commands may use the offline tools."""
    bad = [
        f"{item.source}:{item.line} imports {item.target}"
        for item in graph.imports
        if item.source.split(".")[0] in ("api", "models_app") or item.source.startswith("mlxhost.runtime")
        if item.target.startswith("mlxhost.engine.") and not item.target.startswith(ENGINE_TOOLS)
    ]
    assert not bad, "\n".join(bad)


def test_models_app_never_imports_the_api(graph: Graph) -> None:
    """Use cases sit below the HTTP layer: `models_app` raises its own errors, which `api.errors`
    maps to each surface's envelope."""
    bad = [
        f"{item.source}:{item.line} imports {item.target}"
        for item in graph.imports
        if item.source.split(".")[0] == "models_app" and item.target.split(".")[0] == "api"
    ]
    assert not bad, "\n".join(bad)


def test_runtime_never_imports_the_api(graph: Graph) -> None:
    """The runtime serves the API layer, not the other way round: the composition root lists api's
    hooks (socket shutdown), and api gets the engine from `mlxhost.runtime.get_engine()`."""
    bad = [
        f"{item.source}:{item.line} imports {item.target}"
        for item in graph.imports
        if item.source.startswith("mlxhost.runtime") and item.target.split(".")[0] == "api"
    ]
    assert not bad, "\n".join(bad)


# The layers, lowest first: each may import the ones before it and never one after it, counting
# TYPE_CHECKING and function-local imports too (issue 26, docs/architecture.md "One direction").
LAYERS = ("mlxhost.engine", "mlxhost.runtime", "models_app", "api")
# Above every layer: it lists the hooks of all of them, so nothing in a layer may import it.
COMPOSITION_ROOT = ("mlxhost.composition", "mlxhost.asgi")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _layer_of(module: str) -> int | None:
    return next((rank for rank, package in enumerate(LAYERS) if _in(module, package)), None)


def upward_imports(graph: Graph) -> list[str]:
    """Every import from a layer to one above it, or into the composition root."""
    bad = []
    for item in graph.imports:
        source, target = _layer_of(item.source), _layer_of(item.target)
        if source is None:
            continue
        if (target is not None and target > source) or any(
            _in(item.target, root) for root in COMPOSITION_ROOT
        ):
            bad.append(f"{item.source}:{item.line} imports {item.target} ({item.kind})")
    return bad


def test_the_layers_import_in_one_direction_only(graph: Graph) -> None:
    """Issue 26: api -> models_app -> mlxhost.runtime -> mlxhost.engine, never back. The runtime
    (settings, the one engine, the lifecycle) knows nothing of the database; the use cases that join
    the engine to it (reconcile, the status publisher, the write-behind flush, on-demand binding) live
    in models_app, and `mlxhost.composition` lists their hooks."""
    bad = upward_imports(graph)
    assert not bad, "\n".join(bad)


# The checker itself (so the tests above can fail) --------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return build_graph(tmp_path, ("pkg",))


def test_a_function_local_import_closes_a_cycle(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.a import thing\n",
        },
    )
    assert graph.count("local") == 1
    assert find_cycles(graph.edges()) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from . import b\n",
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\nimport typing\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\n"
                "if typing.TYPE_CHECKING:\n    import pkg.a\nelse:\n    import pkg.c\n"
            ),
            "pkg/c.py": "",
        },
    )
    assert graph.count("type_checking") == 2
    assert graph.edges()["pkg.b"] == {"pkg.c"}
    assert find_cycles(graph.edges()) == []


def test_relative_and_package_imports_resolve(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import x\n",
            "pkg/sub/__init__.py": "from ..other import y\n",
            "pkg/sub/x.py": "import pkg.other\n",
            "pkg/other.py": "from pkg.sub import name_in_init\n",
        },
    )
    edges = graph.edges()
    assert edges["pkg"] == {"pkg.sub.x"}
    assert edges["pkg.sub"] == {"pkg.other"}
    assert edges["pkg.other"] == {"pkg.sub"}
    assert find_cycles(edges) == [["pkg.other", "pkg.sub", "pkg.other"]]


def test_an_upward_import_is_reported_whatever_its_kind(tmp_path: Path) -> None:
    root = tmp_path
    for name, text in {
        "mlxhost/__init__.py": "",
        "mlxhost/engine/__init__.py": "",
        "mlxhost/runtime/__init__.py": "from mlxhost import engine\n",
        "mlxhost/composition.py": "import api.views\n",
        "models_app/__init__.py": "",
        "models_app/turns.py": (
            "from typing import TYPE_CHECKING\nfrom mlxhost import runtime\n"
            "if TYPE_CHECKING:\n    from api import views\n"
        ),
        "api/__init__.py": "",
        "api/views.py": "def f():\n    from mlxhost.composition import HOOKS\n",
        "mlxhost/engine/worker.py": "def f():\n    from models_app import turns\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert sorted(upward_imports(build_graph(root))) == [
        "api.views:2 imports mlxhost.composition (local)",
        "mlxhost.engine.worker:2 imports models_app.turns (local)",
        "models_app.turns:4 imports api.views (type_checking)",
    ]
