"""The folders of kvserve import only down their floors (docs/architecture.md, DESIGN.md).

The order is written once, as data (``FLOORS``); the imports are read from the
code with ``ast``: every ``import`` and ``from ... import`` of a ``kvserve``
module, including those inside functions and ``TYPE_CHECKING`` blocks, with
relative imports resolved. An import names the most specific module it reaches
(``from kvserve.core import scheduler`` is the file ``core/scheduler.py``,
``from kvserve.core import Request`` is ``core/__init__.py``); the parent
packages Python runs on the way are every import's, and are not counted.

Three rules, checked against the code:

- no import loop between files of different folders (a folder is a file's
  parent package; each top-level module of ``kvserve`` counts as its own);
- at most two imports run from a lower floor up to a higher one, each listed in
  ``UPWARD_IMPORTS`` and explained by a comment at the import;
- every top-level module and folder of ``kvserve`` is placed on a floor, once.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "src" / "kvserve"


class Floor(NamedTuple):
    """name: the floor's name in DESIGN.md; members: top-level modules and folders of kvserve
    (``"__init__"`` is the package itself)."""

    name: str
    members: tuple[str, ...]


# Bottom to top: a module imports from its own floor or the floors below it.
FLOORS: tuple[Floor, ...] = (
    # Frozen data every floor shares (the parameters of generation and of embedding
    # requests). The structured-output spec is plain data a
    # SamplingParams carries, so it sits beside it (its compiler is in structured/).
    # cpu_isa reads the CPU's flags before torch loads; json_limits bounds JSON parsing.
    Floor(
        "base",
        (
            "errors",
            "outputs",
            "private_cache",
            "config",
            "sampling_params",
            "pooling_params",
            "structured_params",
            "json_limits",
            "cpu_isa",
        ),
    ),
    Floor("kernels", ("kernels",)),
    # Plain Python over requests. chat/ turns a conversation into a prompt under
    # bounded Jinja: request content like a grammar, below loader/, which refuses
    # a model whose own chat template goes past its limits.
    Floor("bookkeeping", ("core", "sample", "structured", "chat")),
    Floor("model pieces", ("layers", "attention", "distributed")),
    Floor("models", ("models",)),
    Floor("loading", ("loader",)),
    # executor/ starts the tensor-parallel ranks, each of which runs a model runner.
    Floor("worker", ("worker", "executor")),
    Floor("engine", ("engine",)),
    # The package itself re-exports LLM (lazily) with the parameters users import.
    Floor(
        "surfaces",
        ("__init__", "llm", "entrypoints", "serve", "batch", "trace", "dashboard"),
    ),
    # Top floor: nothing below imports them. demo.py is `make demo`; cli.py the `kvserve` command.
    Floor("tools", ("benchmarks", "demos", "demo", "cli")),
)


class Arrow(NamedTuple):
    """An import from ``source`` (a file, relative to src/kvserve) of ``target`` (a module)."""

    source: str
    target: str


# Imports allowed to run up a floor (at most two), each explained by a comment at the import.
UPWARD_IMPORTS: tuple[Arrow, ...] = ()
MAX_UPWARD_IMPORTS = 2


class Import(NamedTuple):
    """One import statement's edge: ``source`` imports ``target`` at ``line``."""

    source: str  # module name of the importing file, e.g. kvserve.core.scheduler
    target: str  # module name of the imported file
    path: Path
    line: int

    def describe(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line} -> {self.target}"


class Package(NamedTuple):
    """A package's files by module name, and the imports between them."""

    root: Path
    files: dict[str, Path]
    imports: list[Import]

    def __repr__(self) -> str:  # pytest prints the fixture: keep the failure readable
        return f"Package({self.root}: {len(self.files)} files, {len(self.imports)} imports)"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_package(root: Path) -> Package:
    """Every file under ``root`` and each import of one of them (outside imports are skipped)."""
    files = {module_name(root, path): path for path in sorted(root.rglob("*.py"))}
    # One edge per statement and target: ``from m import a, b`` is one import of m.
    imports = list(
        dict.fromkeys(
            Import(source, target, path, line)
            for source, path in files.items()
            for target, line in _imported(source, path, files)
            if target != source
        )
    )
    return Package(root, files, imports)


def _imported(source: str, path: Path, files: dict[str, Path]) -> Iterable[tuple[str, int]]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _longest_known(alias.name, files)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(source, is_package, node)
            for alias in node.names:
                # ``from pkg import name``: the submodule pkg.name if there is one, else pkg.
                target = _longest_known(f"{base}.{alias.name}", files)
                if target is not None:
                    yield target, node.lineno


def _absolute(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = source.split(".") if is_package else source.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _longest_known(name: str, files: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in files:
            return ".".join(parts)
        parts.pop()
    return None


def unit(package: Package, module: str) -> str:
    """The folder a module belongs to for loops: the package its file sits in (a package's
    ``__init__.py`` is in the package itself), or the module itself at the top level."""
    if package.files[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == package.root.name else parent


def top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def top_level_names(root: Path) -> set[str]:
    """The modules and folders of Python directly under ``root`` (plus ``__init__``)."""
    return {
        path.stem if path.is_file() else path.name
        for path in root.iterdir()
        if (path.suffix == ".py" and path.is_file()) or (path.is_dir() and any(path.rglob("*.py")))
    }


def loops_between_folders(package: Package) -> list[str]:
    """One message per set of files that import each other around a loop across folders."""
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in package.imports:
        graph[edge.source].add(edge.target)
    messages = []
    for component in strongly_connected(package.files, graph):
        if len({unit(package, module) for module in component}) < 2:
            continue
        edges = sorted(
            edge.describe(package.root)
            for edge in package.imports
            if edge.source in component
            and edge.target in component
            and unit(package, edge.source) != unit(package, edge.target)
        )
        messages.append(f"loop among {sorted(component)}, across folders by: " + "; ".join(edges))
    return messages


def strongly_connected(nodes: Iterable[str], graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def floor_of(floors: Sequence[Floor]) -> dict[str, int]:
    return {member: level for level, floor in enumerate(floors) for member in floor.members}


def upward_imports(package: Package, floors: Sequence[Floor]) -> list[Import]:
    """Imports whose target sits on a higher floor than their file (unplaced names skipped)."""
    level = floor_of(floors)
    return [
        edge
        for edge in package.imports
        if level.get(top_level(edge.target), -1) > level.get(top_level(edge.source), 1 << 30)
    ]


def arrow(package: Package, edge: Import) -> Arrow:
    return Arrow(str(edge.path.relative_to(package.root)), edge.target)


def has_comment_at(path: Path, line: int) -> bool:
    """A comment on the import's first line or on the line right above it."""
    lines = path.read_text().splitlines()
    number = line - 1
    return "#" in lines[number] or (number > 0 and lines[number - 1].strip().startswith("#"))


def upward_violations(
    package: Package, floors: Sequence[Floor], allowed: Sequence[Arrow]
) -> list[str]:
    """One message per upward import not allowed, allowed without a comment, or allowed and gone."""
    level = floor_of(floors)
    found = upward_imports(package, floors)
    messages = [
        f"{edge.describe(package.root)} runs up from floor "
        f"{floors[level[top_level(edge.source)]].name!r} to {floors[level[top_level(edge.target)]].name!r}"
        for edge in found
        if arrow(package, edge) not in allowed
    ]
    messages += [
        f"{edge.describe(package.root)} is allowed up a floor but has no comment saying why"
        for edge in found
        if arrow(package, edge) in allowed and not has_comment_at(edge.path, edge.line)
    ]
    seen = {arrow(package, edge) for edge in found}
    messages += [
        f"{entry} is allowed but no longer imported" for entry in allowed if entry not in seen
    ]
    return messages


def placement_violations(root: Path, floors: Sequence[Floor]) -> list[str]:
    """Top-level names on no floor, names on more than one, and names that no longer exist."""
    placed = [member for floor in floors for member in floor.members]
    present = top_level_names(root) | {"__init__"}
    messages = [
        f"{name} is on no floor: place it in FLOORS" for name in sorted(present - set(placed))
    ]
    messages += [f"{name} is not in kvserve any more" for name in sorted(set(placed) - present)]
    messages += [
        f"{name} is on more than one floor"
        for name in sorted(set(placed))
        if placed.count(name) > 1
    ]
    return messages


@pytest.fixture(scope="module")
def kvserve_package() -> Package:
    return read_package(SOURCE)


def test_no_import_loop_runs_between_folders(kvserve_package: Package) -> None:
    loops = loops_between_folders(kvserve_package)
    if loops:
        pytest.fail("import loops between folders:\n" + "\n".join(loops), pytrace=False)


def test_imports_run_down_the_floors(kvserve_package: Package) -> None:
    assert len(UPWARD_IMPORTS) <= MAX_UPWARD_IMPORTS
    violations = upward_violations(kvserve_package, FLOORS, UPWARD_IMPORTS)
    if violations:
        pytest.fail("imports up a floor:\n" + "\n".join(violations), pytrace=False)


def test_every_top_level_module_is_on_one_floor() -> None:
    violations = placement_violations(SOURCE, FLOORS)
    if violations:
        pytest.fail("\n".join(violations), pytrace=False)


# The reader and the checks, on a package small enough to know every answer.
TOY = {
    "__init__.py": "",
    "low/__init__.py": "from toy.low.a import A\n",
    "low/a.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.high import b\nA = 1\n"
    ),
    "high/__init__.py": "",
    "high/b.py": (
        "def f():\n"
        "    from ..low import a\n"
        "    import toy.low\n"
        "    # the reason it may\n"
        "    from . import c\n"
        "    import os\n"
    ),
    "high/c.py": "from .b import f\n",
    "top.py": "from toy.low import A\n",
}
TOY_FLOORS = (Floor("low", ("low", "__init__")), Floor("high", ("high", "top")))


def write_package(folder: Path, texts: dict[str, str]) -> Package:
    for name, text in texts.items():
        path = folder / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_package(folder / "toy")


@pytest.fixture
def toy(tmp_path: Path) -> Package:
    return write_package(tmp_path, TOY)


def test_the_reader_sees_imports_in_functions_type_checking_and_relative_forms(
    toy: Package,
) -> None:
    edges = {(edge.source, edge.target, edge.line) for edge in toy.imports}
    assert edges == {
        ("toy.low", "toy.low.a", 1),
        ("toy.low.a", "toy.high.b", 3),
        ("toy.high.b", "toy.low.a", 2),
        ("toy.high.b", "toy.low", 3),
        ("toy.high.b", "toy.high.c", 5),
        ("toy.high.c", "toy.high.b", 1),
        ("toy.top", "toy.low", 1),
    }


def test_the_checks_name_the_loop_and_the_upward_import(toy: Package) -> None:
    loops = loops_between_folders(toy)
    assert len(loops) == 1
    assert "toy/low/a.py:3 -> toy.high.b" in loops[0]
    assert "toy/high/b.py:2 -> toy.low.a" in loops[0]
    assert "toy/high/c.py" not in loops[0]  # b <-> c is a loop inside one folder
    assert upward_violations(toy, TOY_FLOORS, ()) == [
        "toy/low/a.py:3 -> toy.high.b runs up from floor 'low' to 'high'"
    ]
    allowed = (Arrow("low/a.py", "toy.high.b"), Arrow("low/a.py", "toy.top"))
    assert upward_violations(toy, TOY_FLOORS, allowed) == [
        "toy/low/a.py:3 -> toy.high.b is allowed up a floor but has no comment saying why",
        f"{allowed[1]} is allowed but no longer imported",
    ]
    assert has_comment_at(toy.files["toy.high.b"], 5)


def test_a_top_level_module_on_no_floor_is_named(toy: Package) -> None:
    assert placement_violations(toy.root, TOY_FLOORS[:1]) == [
        "high is on no floor: place it in FLOORS",
        "top is on no floor: place it in FLOORS",
    ]


def test_a_subpackage_is_a_folder_of_its_own(tmp_path: Path) -> None:
    nested = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "pkg/__init__.py": "",
            "pkg/a.py": "from toy.pkg.sub import B\nA = 1\n",
            "pkg/sub/__init__.py": "from toy.pkg.a import A\nB = 2\n",
        },
    )
    [loop] = loops_between_folders(nested)
    assert "toy/pkg/sub/__init__.py:1 -> toy.pkg.a" in loop
