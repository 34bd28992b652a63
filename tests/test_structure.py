"""The package's shape: short functions, and no import cycle (a static check over every import
statement, function-level ones included: stronger than importing each module alone, which
succeeds for many cycles)."""

import ast

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "dpbench"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
# Stages sit below the compiler and the board: they import neither.
ABOVE_THE_STAGES = ("dpbench.compiler", "dpbench.train", "dpbench.board", "dpbench.search",
                    "dpbench.sweep", "dpbench.audit", "dpbench.main")


def _modules() -> dict:
    """dotted module name -> path, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert not long, long


def _imports(path, modules: dict) -> set:
    """The package modules a file imports, anywhere in it (``from dpbench import x`` counts as
    dpbench.x when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            found.update(submodules)
            # ``from package import submodule`` needs the submodule, not the package's own
            # names: a module of dpbench.compiler importing a sibling this way is no cycle
            if node.module in modules and len(submodules) < len(node.names):
                found.add(node.module)
    return found


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the check can fail: a made-up back edge is found
    graph["dpbench.stages.base"] = graph["dpbench.stages.base"] | {"dpbench.compiler"}
    assert _cycle(graph) is not None


def test_no_module_is_longer_than_400_lines():
    """The package's modules and the benchmark's."""
    paths = dict(_modules(), **{f"benchmarks.{p.stem}": p
                                for p in (REPO_ROOT / "benchmarks").glob("*.py")})
    sizes = {name: len(path.read_text().splitlines()) for name, path in paths.items()}
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"


def _upward(imported: set) -> list:
    return sorted(i for i in imported if i.startswith(ABOVE_THE_STAGES))


def test_no_stage_imports_the_compiler_or_the_board(tmp_path):
    modules = _modules()
    upward = {name: _upward(_imports(path, modules)) for name, path in modules.items()
              if name.startswith("dpbench.stages")}
    assert not any(upward.values()), {k: v for k, v in upward.items() if v}
    # the check can fail: a stage that reaches into the compiler is found
    broken = tmp_path / "broken_stage.py"
    broken.write_text("from dpbench.compiler import bookkeeping\nimport dpbench.board.render\n")
    assert _upward(_imports(broken, modules)) == ["dpbench.board.render",
                                                  "dpbench.compiler.bookkeeping"]


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# What the board must never reach: it reads records, so it needs no compiler, stage, model,
# training or sweep code (and a board rebuild never pays their imports).
NOT_FOR_THE_BOARD = ("dpbench.compiler", "dpbench.stages", "dpbench.train", "dpbench.run",
                     "dpbench.sweep", "dpbench.models", "dpbench.wide_resnet", "dpbench.data")


def test_the_board_reads_records_without_the_compiler_transitively():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}

    def reached():
        return {m for b in modules if b.startswith("dpbench.board")
                for m in _reachable(graph, b) if m.startswith(NOT_FOR_THE_BOARD)}
    assert reached() == set()
    # the check can fail: one made-up import two floors down is found
    graph["dpbench.search.tuning"] = graph["dpbench.search.tuning"] | {"dpbench.compiler.pipeline"}
    assert "dpbench.compiler.pipeline" in reached()


# The floors of the house (WORKSPACE.md, "Floors"): every module sits on one, by its dotted
# name's longest matching prefix ("dpbench.sweep" covers sweep_plan, sweep_cost, ...), and may
# import only its own floor and the floors listed for it.
FLOORS = {
    "core": ("dpbench.accounting", "dpbench.exact", "dpbench.ops", "dpbench.records",
             "dpbench.sampling", "dpbench.sharding", "dpbench.numerics", "dpbench.checkpoint",
             "dpbench.cli_args"),
    "models/data": ("dpbench.models", "dpbench.wide_resnet", "dpbench.data", "dpbench.features"),
    "stages": ("dpbench.stages",),
    "compiler": ("dpbench.compiler",),
    "search": ("dpbench.search",),
    "board": ("dpbench.board",),
    "run": ("dpbench.config", "dpbench.run", "dpbench.run_record", "dpbench.train",
            "dpbench.audit", "dpbench.api"),
    "sweep": ("dpbench.sweep",),
    "cli": ("dpbench", "dpbench.main"),
}
MAY_IMPORT = {
    "core": (),
    "models/data": ("core",),
    "stages": ("core",),
    "compiler": ("core", "models/data", "stages"),
    "search": ("core",),
    "board": ("core", "search"),
    "run": ("core", "models/data", "stages", "compiler", "search"),
    "sweep": ("core", "compiler", "search", "run", "board"),
    "cli": tuple(FLOORS),
}


def floor_of(module: str):
    best = None
    for floor, prefixes in FLOORS.items():
        for prefix in prefixes:
            if module == prefix or (prefix != "dpbench" and module.startswith(
                    (prefix + ".", prefix + "_"))):
                if best is None or len(prefix) > best[1]:
                    best = (floor, len(prefix))
    return None if best is None else best[0]


def _floor_breaks(graph: dict) -> list:
    breaks = []
    for module, imported in graph.items():
        here = floor_of(module)
        for other in imported:
            there = floor_of(other)
            if there != here and there not in MAY_IMPORT[here]:
                breaks.append(f"{module} ({here}) imports {other} ({there})")
    return sorted(breaks)


def test_every_module_sits_on_a_floor_and_imports_only_the_floors_below_it():
    modules = _modules()
    assert not [m for m in modules if floor_of(m) is None]
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _floor_breaks(graph) == []
    # the table is a DAG of floors (no two floors may import each other)
    for floor, below in MAY_IMPORT.items():
        assert floor == "cli" or all(floor not in MAY_IMPORT[b] for b in below), floor
    # the check can fail: a search module reaching into the sweep, a stage into the compiler
    graph["dpbench.search.tuning"] = graph["dpbench.search.tuning"] | {"dpbench.sweep.plan"}
    graph["dpbench.stages.clip"] = graph["dpbench.stages.clip"] | {"dpbench.compiler.rules"}
    assert _floor_breaks(graph) == [
        "dpbench.search.tuning (search) imports dpbench.sweep.plan (sweep)",
        "dpbench.stages.clip (stages) imports dpbench.compiler.rules (compiler)"]


def test_the_longest_import_chain_is_at_most_10_modules():
    """The house's height: the import DAG's longest chain (a module's floor number is one
    more than its highest import's). 15 before the compiler's callers imported its modules
    directly and the sweep read its events without building a run; 11 before the record read
    a run by duck type and the secret search's plan moved to the planning module."""
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    levels = {}

    def level(module):
        if module not in levels:
            levels[module] = 1 + max((level(m) for m in graph[module]), default=0)
        return levels[module]
    assert max(level(m) for m in graph) <= 10, sorted(levels.items(), key=lambda kv: -kv[1])[:8]
