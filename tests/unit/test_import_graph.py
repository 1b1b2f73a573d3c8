"""The package's import graph has no circle and no arrow from a lower layer to a higher one.

Pure ``ast`` over the package's files (nothing is imported). An edge ``a -> b`` is any
``import`` / ``from ... import`` in module ``a`` (at the top or inside a function, under
``TYPE_CHECKING`` too) that names module ``b``: ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to the package ``pkg`` (its ``__init__``).
The parent packages that Python runs before a submodule are not edges (a package's
``__init__`` may import its own modules); the package root ``easgd_lightning`` imports
nothing of the package (its subpackages load lazily, by name), and the strategy registry
finds the strategy modules by their files (``registry.strategy_modules``: plug-ins, not
edges; the modules import the registry).

The layers, low to high (an import goes to the same layer or a lower one):

0. ``easgd_lightning`` (the root), ``utils``, ``compat``, ``conf``, ``config_tree`` -- helpers with no
   notion of training;
1. ``comm`` -- the only module that talks to the process group;
2. ``hooks`` -- compressors, error feedback, the DDP and elastic exchanges;
3. ``parallel``, ``data``, ``models`` -- the pieces a strategy trains;
4. ``strategies`` -- the Lightning strategies and their registry;
5. ``ft`` -- fault tolerance around the strategies;
6. ``fabric``, ``callbacks``, ``guards`` -- Lightning add-ons over the strategies;
7. ``cli`` -- the command line, itself in layers, low to high:

   a. ``cli.targets``, ``cli.rules``, ``cli.values``, ``cli.search``, ``cli.resolvers``,
      ``cli.resume``, ``cli.summary``, ``cli.forkserver`` -- config knowledge (what a
      group's keys are, which values are allowed) and process plumbing with no config;
   b. ``cli.build``, ``cli.trainer_config`` -- registry entries -> objects;
   c. ``cli.validate``, ``cli.overrides`` -- compose and validate a whole config before
      any process starts;
   d. ``cli.launch``, ``cli.worker`` and the fault-tolerant launchers ``ft.launch``,
      ``ft.external`` (modules of ``ft`` that start and watch processes as ``cli.launch``
      does, over it) -- processes;
   e. ``cli.train``, ``cli.demo``, ``cli.report``, ``cli.slurm`` (the SLURM launcher
      plugin's side, over ``cli.train``) -- the console scripts.

Beside the graph: no module of ``cli`` names a strategy or a compression (a string equal
to a registered strategy name, a strategy's Hydra option or a compression name); what the
command line needs of them it asks the registries. :data:`NOT_NAMES` lists the strings
that are such a name by coincidence.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "easgd_lightning"

#: the first component below the root -> its layer (see the module docstring)
LAYERS = {
    "": 0, "utils": 0, "compat": 0, "conf": 0, "config_tree": 0,
    "comm": 1,
    "hooks": 2,
    "parallel": 3, "data": 3, "models": 3,
    "strategies": 4,
    "ft": 5,
    "fabric": 6, "callbacks": 6, "guards": 6,
    "cli": 7,
}
#: inside cli: module -> sub-layer (see the module docstring)
CLI_LAYERS = {
    "targets": 0, "rules": 0, "values": 0, "search": 0, "resolvers": 0, "resume": 0, "summary": 0,
    "forkserver": 0, "__init__": 0,
    "build": 1, "trainer_config": 1,
    "validate": 2, "overrides": 2,
    "launch": 3, "worker": 3,
    "train": 4, "demo": 4, "report": 4, "slurm": 4,
}
#: modules outside cli placed in one of its sub-layers (see the module docstring)
MODULE_LAYERS = {"easgd_lightning.ft.launch": (7, 3), "easgd_lightning.ft.external": (7, 3)}
#: (cli module, string) -> what it is: strings equal to a strategy or compression name that
#: mean something else
NOT_NAMES = {
    ("values.py", "bf16"): "trainer.precision's old spelling of bf16-mixed",
    ("values.py", "none"): "logger.name: no experiment logger",
    ("worker.py", "none"): "logger.name: no experiment logger",
}


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _targets(module: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> set[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    found = {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
    return {m for m in found if m in mods}


@functools.cache
def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (module docstring: what an edge is; read
    once per session, not to be changed)."""
    mods = package_modules(root)
    graph = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(module, path, node, mods)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                    found.append(sorted(component))
    return found


def layer(module: str) -> tuple[int, int]:
    """(layer, cli sub-layer) of a module (module docstring)."""
    if module in MODULE_LAYERS:
        return MODULE_LAYERS[module]
    parts = module.split(".")[1:]
    top = parts[0] if parts else ""
    if top not in LAYERS:
        raise AssertionError(f"{module}: {top!r} has no layer; add it to LAYERS and the docstring")
    if top != "cli":
        return LAYERS[top], 0
    name = parts[1] if len(parts) > 1 else "__init__"
    if name not in CLI_LAYERS:
        raise AssertionError(f"{module}: no cli sub-layer; add it to CLI_LAYERS and the docstring")
    return LAYERS[top], CLI_LAYERS[name]


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a higher layer's module ``b`` by ``a``."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]


def test_the_graph_is_read() -> None:
    # the reader itself: an edge known to exist, relative and function-level imports resolved
    graph = import_graph()
    assert "easgd_lightning.strategies.registry" in graph["easgd_lightning.strategies.ddp"]
    assert "easgd_lightning.cli.build" in graph["easgd_lightning.cli.worker"]  # inside run_worker
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        described.append(f"{len(component)} modules: " + "; ".join(edges))
    assert not found, "import circles:\n" + "\n".join(described)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    up = upward_edges(import_graph())
    assert not up, "imports from a lower layer to a higher one (module docstring):\n" + "\n".join(up)


def test_the_root_imports_nothing_of_the_package() -> None:
    assert import_graph()["easgd_lightning"] == set()


def _names() -> set[str]:
    """Every registered strategy name, Hydra strategy option and compression name."""
    from easgd_lightning.hooks.compressors import compressor_names
    from easgd_lightning.strategies.registry import strategy_specs

    specs = strategy_specs().values()
    return {s.name for s in specs} | {s.config_name for s in specs} | set(compressor_names())


def test_the_cli_names_no_strategy_and_no_compression() -> None:
    names = _names()
    assert {"ddp", "ddp_compressed", "pipeline_3d", "none", "optimus_cc", "topk"} <= names  # the reader
    found = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in names and (path.name, node.value) not in NOT_NAMES:
                found.append(f"cli/{path.name}:{node.lineno}: {node.value!r}")
    assert not found, "strategy or compression names in cli/ (ask the registries instead):\n" + "\n".join(found)


def test_no_cli_function_is_over_60_lines() -> None:
    long = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"cli/{path.name}:{node.lineno}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
