"""The package's shape: short functions, and no import cycle (a static check over every import
statement, function-level ones included: stronger than importing each module alone, which
succeeds for many cycles)."""

import ast

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "dpbench"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
# Stages sit below the compiler and the board: they import neither.
ABOVE_THE_STAGES = ("dpbench.compiler", "dpbench.run", "dpbench.board", "dpbench.search",
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
NOT_FOR_THE_BOARD = ("dpbench.compiler", "dpbench.stages", "dpbench.run",
                     "dpbench.sweep", "dpbench.models", "dpbench.data")


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
    "models/data": ("dpbench.models", "dpbench.data", "dpbench.features"),
    "stages": ("dpbench.stages",),
    "compiler": ("dpbench.compiler",),
    "search": ("dpbench.search",),
    "board": ("dpbench.board",),
    "run": ("dpbench.config", "dpbench.run", "dpbench.audit", "dpbench.api"),
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
    graph["dpbench.search.tuning"] = graph["dpbench.search.tuning"] | {"dpbench.sweep.planning"}
    graph["dpbench.stages.clip"] = graph["dpbench.stages.clip"] | {"dpbench.compiler.rules"}
    assert _floor_breaks(graph) == [
        "dpbench.search.tuning (search) imports dpbench.sweep.planning (sweep)",
        "dpbench.stages.clip (stages) imports dpbench.compiler.rules (compiler)"]


def test_the_longest_import_chain_is_at_most_10_modules():
    """The house's height: the import DAG's longest chain (a module's floor number is one
    more than its highest import's): a deep chain is a module that knows too much."""
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    levels = {}

    def level(module):
        if module not in levels:
            levels[module] = 1 + max((level(m) for m in graph[module]), default=0)
        return levels[module]
    assert max(level(m) for m in graph) <= 10, sorted(levels.items(), key=lambda kv: -kv[1])[:8]


def _settings_computed(tree) -> list:
    """(line, keys) of every dict (a ``dict(...)`` call or a literal) with at least 3 entries
    keyed by names of ``Settings`` whose values are derived from an object (an attribute or a
    call): settings computed there. Reading one (``record["seed"]``) or passing one on
    (``delta=delta``) is not computing it, and one or two such names in a dict are another
    object's facts that share a name (a sampler's ``dataset_size``)."""
    from dpbench.run.settings import Settings
    names = {f.name for f in __import__("dataclasses").fields(Settings)}
    derived = (ast.Attribute, ast.Call)
    found = []
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "dict":
            pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
        elif isinstance(node, ast.Dict):
            pairs = [(k.value, v) for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        keys = [key for key, value in pairs
                if key in names and any(isinstance(n, derived) for n in ast.walk(value))]
        if len(keys) >= 3:
            found.append((node.lineno, sorted(keys)))
    return found


def test_only_the_run_package_computes_a_setting_its_record_holds():
    """Settings are computed once (``dpbench.run.settings``): no module of dpbench outside
    ``dpbench/run/`` builds a dict holding a setting derived from the config, the budget, the
    data or the compiled pipeline. The check can fail: a second settings dict is found."""
    outside = {name: path for name, path in _modules().items()
               if not (name == "dpbench.run" or name.startswith("dpbench.run."))}
    found = {name: hits for name, path in outside.items()
             if (hits := _settings_computed(ast.parse(path.read_text())))}
    assert found == {}, found
    twin = ast.parse("def record(config, budget, n):\n"
                     "    return dict(batch_size=config.batch_size, delta=budget.delta,\n"
                     "                seed=config.seed, dataset_size=n)\n")
    assert _settings_computed(twin) == [(2, ["batch_size", "delta", "seed"])]


def _room(module: str) -> str:
    """A module's room: its top-level module or package of dpbench, or its folder."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "dpbench" and len(parts) > 1 else parts[0]


def house(folders=("dpbench", "benchmarks", "tools")) -> tuple:
    """(rooms, import edges between rooms, layers): the repository's shape, each top-level
    module and package of dpbench and each other folder of Python one room."""
    modules = {}
    for folder in folders:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {(_room(name), _room(other)) for name, path in modules.items()
             for other in _imports(path, modules) if other != "dpbench"} - {
        (r, r) for r in map(_room, modules)}
    rooms = {_room(m) for m in modules}
    graph = {r: {b for a, b in edges if a == r} for r in rooms}
    levels = {}

    def level(room, seen=()):
        if room not in levels:
            levels[room] = 1 + max((level(r, seen + (room,)) for r in graph[room]
                                    if r not in seen), default=0)
        return levels[room]

    return rooms, edges, max(level(r) for r in rooms)


def test_the_house_has_at_most_7_layers_and_86_import_edges_between_rooms():
    """The house's shape, held where it stands (26 rooms): a change that adds a layer or an
    edge between rooms raises the bound here and says why. 86: tools/compare_rerun.py reads a
    rerun's records with search/tuning's own readers (a winner by the board's rule, not a
    second copy of it). 88: the search keys its answers on disk by the host's numerics
    (search/answers.py -> numerics), and the package versions a record and the audit name
    moved to numerics (one function, which both numerics and records needed). 87: the sweep's
    pool moved from tools/ into the package (sweep/local.py). 86: the rerun's comparison moved
    from tools/ into the board (board/rerun.py)."""
    rooms, edges, layers = house()
    assert layers <= 7 and len(edges) <= 86, (len(rooms), len(edges), layers)


def _python_files(*folders) -> dict:
    """repo-relative path -> parsed tree, for every Python file under ``folders``."""
    return {str(p.relative_to(REPO_ROOT)): ast.parse(p.read_text())
            for folder in folders for p in sorted((REPO_ROOT / folder).rglob("*.py"))}


def _launches_dpbench(node) -> bool:
    """A command list that runs a dpbench module (``[..., "-m", "dpbench...", ...]``)."""
    if not isinstance(node, ast.List):
        return False
    words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(
        e.value, str)]
    return any(a == "-m" and b.startswith("dpbench") for a, b in zip(words, words[1:]))


def test_one_training_loop_one_launcher_one_packing_rule():
    """Trials go to the device one way. One loop: the only function that steps trials between
    two Ctrl-C checks is run/loop.train_members. One launcher: the only command line in the
    package or tools/ that starts a dpbench process to train is run/launch.launch_command
    (``dpbench train --trials``, whose main trains through run/trials: an import the house sees,
    as is the sweep's through run/launch). One packing rule: what may differ within a group is
    declared in run/settings.py alone (read off a job's bindings by sweep/jobs.structure_of; no
    other module defines a shape or group key, or names a setting's gin key to pack by), and only run/group.py and compiler/group.py read a traced
    program's signature. A second copy of any of them fails this test."""
    files = _python_files("dpbench", "tools")
    loops, launchers, declarations, signatures, gin_keys = [], [], [], [], []
    for path, tree in files.items():
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            if any(isinstance(n, ast.Attribute) and n.attr == "between_steps"
                   for n in ast.walk(fn)):
                loops.append(f"{path}:{fn.name}")
            if any(_launches_dpbench(n) for n in ast.walk(fn)):
                launchers.append(f"{path}:{fn.name}")
            if fn.name in ("shape_of", "structure_of", "group_key", "binding_structure") \
                    and path.startswith(("dpbench/run", "dpbench/sweep", "tools")):
                declarations.append(f"{path}:{fn.name}")
        signatures += [path for n in ast.walk(tree)  # a traced program's, not inspect's
                       if isinstance(n, ast.Attribute) and n.attr == "signature"
                       and not (isinstance(n.value, ast.Name) and n.value.id == "inspect")][:1]
        gin_keys += [path for n in ast.walk(tree) if isinstance(n, ast.Constant)
                     and n.value in ("train.batch_size", "train.micro_batch_size")][:1]
    assert loops == ["dpbench/run/loop.py:train_members"], loops
    assert launchers == ["dpbench/run/launch.py:launch_command"], launchers
    # the declaration (settings.py) and the sweep's reading of it off a job's bindings
    assert sorted(declarations) == ["dpbench/run/settings.py:binding_structure",
                                    "dpbench/run/settings.py:group_key",
                                    "dpbench/sweep/jobs.py:structure_of"], declarations
    assert sorted(signatures) == ["dpbench/compiler/group.py", "dpbench/run/group.py"], signatures
    packers = [p for p in gin_keys if p.startswith(("dpbench/sweep", "dpbench/run", "tools"))]
    assert not packers, f"a setting's gin key named where trials are packed: {packers}"
    graph = {name: _imports(path, _modules()) for name, path in _modules().items()}
    assert "dpbench.run.trials" in graph["dpbench.main"]
    assert "dpbench.run.launch" in graph["dpbench.sweep.jobs"]


def test_the_board_imports_at_module_level_only(tmp_path):
    """Every import of dpbench/board/ sits at its module's top, where a reader (and the floor
    table above) sees it: none inside a function, so no edge of the board hides in a call. The
    check itself fails on a module that imports inside a function."""
    def hidden(path):
        out = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out += [f"{path.name}:{sub.lineno}" for sub in ast.walk(node)
                        if isinstance(sub, (ast.Import, ast.ImportFrom))]
        return out
    board_dir = PACKAGE / "board"
    assert [h for p in sorted(board_dir.glob("*.py")) for h in hidden(p)] == []
    broken = tmp_path / "late.py"
    broken.write_text("def f():\n    from dpbench.board import paired\n")
    assert hidden(broken) == ["late.py:2"]
