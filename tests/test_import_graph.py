"""The import graph of sdbench, read from the source with `ast`: no module imports itself back through others,
and the top-level folders (engine, drafting, strategies, dsi, models, kv, data, analysis, commands, reporting,
and each top-level module) form layers, not loops; nothing below the commands imports them.

Every import counts wherever it is written: at module level, inside a function (a lazy import still ties the
two modules together), under `if TYPE_CHECKING:`, and the "sdbench.module:attr" targets a registry imports on
first use.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdbench"
LAZY_TARGET = re.compile(r"^(sdbench(?:\.\w+)+)(?::\w+)?$")  # "sdbench.strategies.draft:DraftModel"

# folder cycles that could not be broken, each as a frozenset of folder names; keep it empty
ALLOWED_FOLDER_CYCLES: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, package: str, modules: dict) -> list[str]:
    """The sdbench modules one node imports: `from a import b` is a.b when that is a module, else a."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := LAZY_TARGET.match(node.value)):
        return [m.group(1)]
    return []


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {sdbench module it imports: the line of the first such import}."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, package, modules):
                if target.split(".")[0] == "sdbench" and target != name:
                    assert target in modules, f"{path}:{node.lineno} imports {target}, which is not a module"
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
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
                    work.append((child, iter(graph.get(child, ()))))
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


def folder(module: str) -> str:
    """sdbench.engine.loop -> engine; sdbench.cli -> cli (each top-level module is its own layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sdbench"


def _where(graph: dict, members: list[str], key=lambda m: m) -> str:
    inside = set(members)
    return "\n".join(f"  {m} -> {t} (line {line})" for m, edges in sorted(graph.items()) for t, line in edges.items()
                     if key(m) in inside and key(t) in inside and key(m) != key(t))


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) == []


def test_the_graph_sees_lazy_and_registry_imports():
    graph = import_graph()
    assert "sdbench.commands.tune" in graph["sdbench.cli.measure"]  # imported inside the `tune` command
    assert "sdbench.strategies.draft" in graph["sdbench.strategies"]  # a registry's "module:attr" target
    assert "sdbench.config" in graph["sdbench.cli.measure"]  # from sdbench import config


def test_no_module_imports_itself_back():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_where(graph, c) for c in found)


def test_top_level_folders_form_layers():
    graph = import_graph()
    folders: dict[str, dict[str, int]] = {}
    for module, edges in graph.items():
        mine = folders.setdefault(folder(module), {})
        for target in edges:
            if folder(target) != folder(module):
                mine.setdefault(folder(target), 0)
    found = [c for c in cycles(folders) if frozenset(c) not in ALLOWED_FOLDER_CYCLES]
    assert not found, "folder cycles:\n" + "\n".join(f"{c}:\n{_where(graph, c, folder)}" for c in found)


# what sits below the commands: it is called by them and never calls them back
BELOW_COMMANDS = ("analysis", "engine", "strategies", "drafting", "dsi", "models", "kv", "data", "reporting",
                  "training", "servers")


def imports_of_commands(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """(module, command module it imports) -> line, for every module of a folder below the commands."""
    return {(m, t): line for m, edges in graph.items() for t, line in edges.items()
            if folder(m) in BELOW_COMMANDS and folder(t) == "commands"}


def test_nothing_below_the_commands_imports_them():
    found = imports_of_commands(import_graph())
    assert not found, "\n".join(f"  {m} -> {t} (line {line})" for (m, t), line in sorted(found.items()))


def test_an_import_of_the_commands_from_below_is_found():
    for below in ("analysis", "engine", "strategies"):
        graph = {f"sdbench.{below}.x": {"sdbench.commands.predict": 3, "sdbench.errors": 1}, "sdbench.cli": {}}
        assert imports_of_commands(graph) == {(f"sdbench.{below}.x", "sdbench.commands.predict"): 3}
    assert not imports_of_commands({"sdbench.cli": {"sdbench.commands.predict": 1}})


def test_every_folder_has_its_place():
    """A new folder is the command line (above the commands), the commands, or below them (BELOW_COMMANDS), so
    that the test above sees it."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(BELOW_COMMANDS) | {"commands", "cli"}


def test_only_the_models_package_touches_the_cpu_fast_path():
    """Packing the weights is the runner's business: every other module asks a runner (share_plain, own_layout,
    plain), so that no command or strategy flips a model's layout behind a runner's back."""
    graph = import_graph()
    fast_path = {f"sdbench.models.forward.{name}"
                 for name in ("cpufast", "cpupacked", "cpuhead", "cpuchoice", "cpumeasure")}
    found = sorted(m for m, edges in graph.items() if fast_path & set(edges) and folder(m) != "models")
    assert not found, found
