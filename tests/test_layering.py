"""The source tree's layering, read from the code (its AST, nothing imported): imports go
one way, down the floors below, and no import circle exists. docs/ARCHITECTURE.md
explains the floors; this test keeps the tree from drifting back.

What counts as an import: every `import` and `from ... import` statement anywhere in a
module — at the top, inside a function (a lazy import is still an arrow: it runs, only
later), inside a try. Only those under `if TYPE_CHECKING:` are left out (annotations,
never run). Names loaded by a string (importlib, the actor-class table of
actors/runtime/process.py, the model registry of actors/models/registry.py) are not
imports: that is how a lower floor names what it loads without depending on it.

The rules:
- a module imports nothing from a floor above its own;
- the actor roles do not import one another (they talk by messages);
- no circle among modules, counting both top-level and lazy imports;
- actors/ has at most four loose modules, and no source file is over 400 lines."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("messages", "kernels", "actors", "api")

# bottom first; a module belongs to the floor of the longest prefix that names it
FLOORS: list[tuple[str, ...]] = [
    ("messages",),  # data and how it travels
    ("actors.config", "actors.errors"),  # torch-free configuration, env, flags' machinery; the errors callers get
    ("actors.runtime", "kernels"),  # the actor base and its processes; the math
    ("actors.layers",),  # attention, tensor-parallel linears, sampling and logits processors
    ("actors.models",),  # the model families, their registry and the loader
    ("actors.lora", "actors.multimodal", "actors.pooling", "actors.quantization", "actors.spec_decode",
     "actors.structured_output", "actors.tracing"),  # features
    ("actors.input_processor", "actors.scheduler", "actors.worker", "actors.detokenizer"),  # actor roles
    ("actors.engine",),  # engine assembly: EngineArgs, supervisor, executors, the in-process core
    ("actors.frontend",),  # the client in the caller's process: AsyncClient, LLM
    ("api",),  # the HTTP server
    ("actors.launch", "actors"),  # entry points (`actors` is actors/__init__.py)
]
ROLES = ("actors.input_processor", "actors.scheduler", "actors.worker", "actors.detokenizer")
MAX_LOOSE_MODULES = 4
MAX_LINES = 400


def module_files() -> dict[str, str]:
    """dotted module name -> path, for every .py file of the packages."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: str, modules: dict[str, str]) -> list[tuple[str, int]]:
    """(imported module of the tree, line) for each import outside TYPE_CHECKING blocks."""
    with open(path) as source:
        tree = ast.parse(source.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # a name inside a module: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append((target, line))

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                add(f"{base}.{alias.name}", node.lineno)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                walk(child)
        else:
            for child in ast.iter_child_nodes(node):
                walk(child)

    walk(tree)
    return found


def floor_of(name: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{name} is on no floor: add its folder to FLOORS (tests/test_layering.py)"
    return best


def role_of(name: str) -> str | None:
    return next((role for role in ROLES if name == role or name.startswith(role + ".")), None)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_is_on_a_floor(graph):
    for name in graph:
        floor_of(name)


def test_no_import_from_a_floor_above(graph):
    upward = [f"{name} (floor {floor_of(name)}) line {line} imports {target} (floor {floor_of(target)})"
              for name, targets in graph.items() for target, line in targets if floor_of(target) > floor_of(name)]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_actor_roles_do_not_import_one_another(graph):
    crossing = [f"{name} line {line} imports {target}" for name, targets in graph.items() for target, line in targets
                if role_of(name) and role_of(target) and role_of(name) != role_of(target)]
    assert not crossing, "roles importing one another (they talk by messages):\n" + "\n".join(crossing)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                    found.append(sorted(component))
    return found


def test_no_import_circle(graph):
    edges = {name: {target for target, _ in targets} for name, targets in graph.items()}
    found = circles(edges)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in found)


def test_actors_has_few_loose_modules():
    loose = sorted(name for name in os.listdir(os.path.join(ROOT, "actors")) if name.endswith(".py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_source_file_is_over_400_lines():
    long = []
    for package in PACKAGES + ("tests", "benchmarks", "examples"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as source:
                        lines = sum(1 for _ in source)
                    if lines > MAX_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)}: {lines}")
    assert not long, long
