"""The package's import graph: no cycles, layers that only import downwards, a light face.

Ray Train guards the same with ``python/ray/tests/test_circular_imports.py``. The graph is
read with ``ast`` from the source, so it sees function-level imports too (a cycle through a
function body fails only when that function runs, which is the worst time to find out).
Imports under ``if TYPE_CHECKING:`` never run and are left out; imports by a computed name
(``importlib.import_module(f"...{name}")``, the dataset registry's lazy readers) are not seen.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "raytrain_mgpu"
SOURCE = ROOT / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(SOURCE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every Import/ImportFrom at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for node in child.orelse:
                yield from _import_nodes(ast.Module(body=[node], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _imported_modules(name: str, path: Path) -> Set[str]:
    """The package modules that ``name`` imports (``from a import b``, b a submodule: ``a.b``)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


@pytest.fixture(scope="module")
def graph() -> Dict[str, Set[str]]:
    """Each package module's imports of the package (read when a test asks, not when pytest collects)."""
    return {name: _imported_modules(name, path) for name, path in MODULES.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: Dict[str, Set[str]], component: Set[str]) -> List[str]:
    """A shortest cycle through the component's first module, to print."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(component)


# ----------------------------------------------------------------------------- layers

# Lowest first. A module may import (at any depth, function bodies included) modules of its
# own layer and of the layers below, never above. A module belongs to the layer of the
# longest prefix listed, so a
# new module lands in its package's layer without an edit here.
LAYERS = [
    # Standard library only: credential redaction, the `module:function` factory loader, size parsing,
    # the config error's shape, the errors that cross process boundaries whole; the YAML value reader
    # (PyYAML) and the command-line helpers the CLI and the benchmarks share.
    ("config.redact", "config.factories", "config.units", "config.names", "errors", "config.yaml_values",
     "_cli_options"),
    # What knows nothing of a run: plain nn.Modules with their registry and partitioning,
    # and the dataset readers with theirs. Each receives its config section duck-typed (the
    # DataConfig import is under TYPE_CHECKING), so both sit below the config. objectives (the
    # loss and metric registries) is torch functions on outputs and targets, like the models: it
    # sits with them, below the config checks (which read its names) and the strategies and
    # pipeline stages (which apply it).
    ("models", "data", "engine.objectives", "engine.batches"),
    # The config checks a model or dataset name against those registries; everything
    # above reads the config.
    ("config",),
    # The engine: one rank's run, whatever carries it (no Ray, no transport: test_engine_imports_no_ray below),
    # and the optimizer from its section.
    ("engine", "checkpointing"),
    # The pipeline's schedules as data, its partition plan, its executor and point-to-point channels: the
    # pipeline strategies validate a config against the plan; a stage's step runner runs the executor.
    ("pipeline",),
    # The worker side of the strategies: the placement and replication steps a Ray Train worker
    # applies to the model, composed from a strategy class's names for them; the step runners.
    ("parallel",),
    # One class per strategy, on the driver: rules, layout, memory model, its runner and its two
    # worker steps by name (no torch); the run plan, derived once and handed down.
    ("strategies",),
    # The driver's services: checks before Ray, the cluster, the run lock, progress, callbacks, loggers, export.
    ("driver",),
    # The transports that carry the engine: Ray Train's workers, the pipeline's actor group, the driver's own
    # process; their base (rank start, result, retry policy).
    ("transports",),
    # Choosing and comparing layouts: memory estimates, strategy="auto", compare. Above the
    # runners (it reads their plans), below the api: compare and auto_measure train through
    # the api's fit, which the api passes in.
    ("planning",),
    # fit and the public compare; plot draws finished (or running) runs' histories, beside the api.
    ("api", "plot", "tune"),
    # The package face (loads the api lazily) and the benchmarks, which drive fit; nothing in
    # the training path imports a benchmark.
    (PACKAGE, "bench"),
    # The command line, the face of everything.
    ("cli",),
]

# Imports that break the order today, each with its owner; remove an entry once fixed.
KNOWN_UPWARD_IMPORTS = {
    # By design, not a debt: a config is validated by its strategy's class (batch split,
    # devices, options it reads), as Ray Train's ScalingConfig is by the trainer. The import is
    # inside config_checks.validate, after the cheap name checks, and strategies never import
    # the config module at run time, so there is no cycle.
    ("config.checks", "strategies"): "validation asks the strategy class",
}


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else module


def _layer(module: str) -> int:
    short = _short(module)
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (short == prefix or short.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best is not None, f"{module} is in no layer: add it (or its package) to LAYERS"
    return best


def _allowed(importer: str, imported: str) -> bool:
    return any(_short(importer) == a and (_short(imported) == b or _short(imported).startswith(b + "."))
               for a, b in KNOWN_UPWARD_IMPORTS)


def test_import_graph_has_no_cycles(graph):
    cycles = _cycles(graph)  # every edge, the allowed upward ones included
    for cycle in cycles:
        print("cycle:", " -> ".join(cycle))
    assert not cycles, f"{len(cycles)} import cycle(s): " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_engine_imports_neither_ray_nor_a_transport_nor_the_drivers_services():
    """engine/ is one rank's run whatever carries it: Ray, the transports and the driver's services come to it
    through the transport it is handed (every import at any depth counts, function bodies included)."""
    found = []
    for name, path in MODULES.items():
        if not _short(name).startswith(("engine", "checkpointing")):
            continue
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            targets = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""])
            found += [f"{_short(name)} imports {t}" for t in targets
                      if t == "ray" or t.startswith(("ray.", f"{PACKAGE}.transports", f"{PACKAGE}.driver"))]
    assert not found, "\n".join(found)


def test_layers(graph):
    upward = [f"{_short(m)} (layer {_layer(m)}) imports {_short(t)} (layer {_layer(t)})"
              for m in sorted(graph) for t in sorted(graph[m])
              if _layer(t) > _layer(m) and not _allowed(m, t)]
    assert not upward, "imports against the layer order (tests/test_imports.py LAYERS):\n" + "\n".join(upward)
    bench_users = [f"{_short(m)} imports {_short(t)}" for m in sorted(graph) for t in sorted(graph[m])
                   if _short(t).startswith("bench") and not _short(m).startswith("bench") and _short(m) != "cli"]
    assert not bench_users, "the benchmarks are outside the training path:\n" + "\n".join(bench_users)


# ----------------------------------------------------------------------------- importing for real

_FRESH_IMPORTS = r"""
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    # Our package's modules only: torch and Ray stay loaded (they cannot be in our cycles),
    # which makes ~70 fresh imports take seconds instead of a subprocess each.
    for key in [k for k in sys.modules if k == "raytrain_mgpu" or k.startswith("raytrain_mgpu.")]:
        del sys.modules[key]
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed.append(name + ": " + "".join(traceback.format_exception_only(type(exc), exc)).strip())
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_every_module_imports_first_in_a_fresh_interpreter():
    # The ast graph cannot see a cycle that only the import order exposes (a module that
    # needs a name its importer has not defined yet); importing each module first, with
    # none of the package loaded, does.
    done = _python(_FRESH_IMPORTS, *MODULES, timeout=300)
    assert done.returncode == 0, f"modules that fail to import first:\n{done.stdout}{done.stderr[-3000:]}"


_LIGHT_FACE = r"""
import sys, time

def heavy():  # torch, Ray, and any benchmark module (they drive fit; --help must not load one)
    return sorted(m for m in sys.modules if m in ("torch", "ray") or m.startswith("raytrain_mgpu.bench"))

def step(what, action):
    start = time.perf_counter()
    try:
        result = action()
    except SystemExit as exc:
        result = f"exit {exc.code}"
    print(f"{what}|{result}|{','.join(heavy())}|{time.perf_counter() - start:.2f}")

import raytrain_mgpu
step("import raytrain_mgpu", lambda: raytrain_mgpu.__version__)
import raytrain_mgpu.config.train
from raytrain_mgpu.cli import main
step("main(['--help'])", lambda: main(["--help"]))
step("main(['--version'])", lambda: main(["--version"]))
step("main(['train', '--epochs', '0'])", lambda: main(["train", "--epochs", "0"]))

def every_strategy():  # a valid config of each, its strategy's rules checked (config_checks.validate)
    layouts = {"dp": dict(num_workers=1, gpus_per_worker=2), "dp_balanced": dict(num_workers=1, gpus_per_worker=2),
               "mp": dict(num_workers=1, gpus_per_worker=2), "ddp2": dict(gpus_per_worker=2),
               "ddp_mp": dict(gpus_per_worker=2), "pipeline": dict(num_stages=2), "ddp_pipeline": dict(num_stages=2)}
    names = ["ddp", "fsdp", "auto", *layouts]
    for name in names:
        raytrain_mgpu.TrainConfig(strategy=name, metrics=["accuracy", "mae"], **layouts.get(name, {}))
    return len(names)

step("TrainConfig(...) of every strategy", every_strategy)
step("main(['bench', '--help'])", lambda: main(["bench", "--help"]))
"""


def test_help_config_errors_and_every_strategys_config_import_neither_torch_nor_ray():
    # `raytrain-mgpu --help` took 5-6 s when the package face imported torch (~3 s) and Ray
    # (~3 s) for it; the answer to --help, --version or a bad value needs neither, nor does a
    # TrainConfig: the strategy classes it asks are plain rules (the worker side is parallel/).
    done = _python(_LIGHT_FACE)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {}
    for line in done.stdout.splitlines():
        if line.count("|") == 3:
            what, result, heavy, seconds = line.split("|")
            steps[what] = (result, heavy)
            print(f"{what}: {result} in {seconds} s, heavy modules loaded: {heavy or 'none'}")
    light = ["import raytrain_mgpu", "main(['--help'])", "main(['--version'])", "main(['train', '--epochs', '0'])",
             "TrainConfig(...) of every strategy"]
    assert [steps[w][1] for w in light] == [""] * len(light), steps
    assert steps["TrainConfig(...) of every strategy"][0] == "10"  # all nine strategies and auto built
    assert steps["main(['--help'])"][0] == "exit 0" and steps["main(['train', '--epochs', '0'])"][0] == "2"
    assert steps["import raytrain_mgpu"][0] in done.stdout and "raytrain-mgpu 0.1.0" in done.stdout
    assert steps["main(['bench', '--help'])"][0] == "exit 0" and "--num-samples" in done.stdout  # loaded on use


_CHECKS_WITHOUT_DYNAMO = r"""
import sys
import torch
import raytrain_mgpu as rtm
from raytrain_mgpu.driver.preflight import check_model_builds

cfg = rtm.TrainConfig(model="lenet", dataset="digits", optimizer="adamw")
check_model_builds(cfg, (1, 8, 8), 10)
print("dynamo after the check:", "torch._dynamo" in sys.modules)
print("slot left:", hasattr(torch.optim.Optimizer.add_param_group.__wrapped__, "__dynamo_disable"))
try:
    check_model_builds(cfg.replace(optimizer_kwargs={"betas": 3}), (1, 8, 8), 10)
except ValueError as exc:
    print("refused:", "optimizer_kwargs={'betas': 3}" in str(exc))
torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
print("dynamo after an optimizer outside the check:", "torch._dynamo" in sys.modules)
"""


def test_fits_model_and_optimizer_check_imports_no_dynamo_and_leaves_torch_as_it_was():
    # The driver builds the optimizer only to check it; torch's dynamo-disabling wrapper of add_param_group
    # imports torch._dynamo at its first call (~1 s of a Ray fit's start on 2 cores, on the driver's
    # critical path). The check still refuses bad kwargs, and an optimizer built after it imports dynamo
    # as torch means it to (the wrapper's cache slot is not left filled).
    done = _python(_CHECKS_WITHOUT_DYNAMO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["dynamo after the check: False", "slot left: False", "refused: True",
                                        "dynamo after an optimizer outside the check: True"], done.stdout


# ----------------------------------------------------------------------------- late imports

# A module's header says what it depends on: an import of the package or of a third-party module inside a function
# says why it is late with a `# late: <reason>` comment (a start-up cost it keeps out of --help, a config check or a
# rank's start; an optional dependency; a cycle; a name a test replaces), on its own lines or on the comment and
# import lines right above its group of imports. Every module of the package is checked (a new one too) but those
# below; the standard library may be imported anywhere.
# Not checked, each with why; remove an entry once its late imports say why.
LATE_IMPORTS_UNCHECKED = {
    "bench": "the benchmarks are outside the training path (only the CLI imports one, when it runs) and some run as "
             "scripts of their own (torchrun's processes); their late imports have not been gone through",
}


def _is_stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


def _statement_lists(tree: ast.AST) -> Iterator[list]:
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], (ast.stmt, ast.excepthandler)):
                yield block


def _late_imports_without_reason(path: Path) -> List[str]:
    """``path:line: import`` for each function-level import of the package or a third-party module whose group
    (consecutive import statements, with the comment lines right above them) carries no ``# late:``."""
    source = path.read_text()
    lines = source.splitlines()
    found = set()
    for function in ast.walk(ast.parse(source, str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for block in _statement_lists(function):
            group: list = []
            for statement in [*block, None]:
                if isinstance(statement, (ast.Import, ast.ImportFrom)):
                    group.append(statement)
                    continue
                if group:
                    first = group[0].lineno - 1
                    while first > 0 and lines[first - 1].strip().startswith("#"):
                        first -= 1
                    if not any("# late:" in line for line in lines[first:group[-1].end_lineno]):
                        for node in group:
                            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                                     else [PACKAGE if node.level else node.module or ""])
                            if not all(_is_stdlib(name) for name in names):
                                found.add((node.lineno, lines[node.lineno - 1].strip()))
                group = []
    return [f"{path.relative_to(ROOT)}:{line}: {text}" for line, text in sorted(found)]


def test_every_late_import_says_why():
    """A function-level import of the package or a third-party module carries ``# late: <reason>``; otherwise it
    belongs at the top of its module, where a reader looks for what the module depends on."""
    def within(name: str, folders) -> bool:
        return any(_short(name) == f or _short(name).startswith(f + ".") for f in folders)

    found = []
    for name, path in MODULES.items():
        if not within(name, LATE_IMPORTS_UNCHECKED):
            found += _late_imports_without_reason(path)
    assert not found, ("function-level imports with no `# late: <reason>` comment (move them to the top of the "
                       "module, or say why they are late):\n" + "\n".join(found))


# ----------------------------------------------------------------------------- size

MAX_LINES = 400
# Modules still over the limit, with their line count when listed: split them, then drop them here.
OVER_MAX_LINES: Dict[str, int] = {}


def test_no_module_over_400_lines():
    sizes = {_short(m): len(p.read_text().splitlines()) for m, p in MODULES.items()}
    over = {m: n for m, n in sizes.items() if n > MAX_LINES and m not in OVER_MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them: a module a reader can hold in mind): {over}"


def test_no_folder_holds_more_than_a_fifth_of_the_package():
    """The folders are the parts a reader looks for; none holds more than a fifth of the lines (bench/ aside: it is
    outside the training path). A folder past it hides parts that deserve a name of their own."""
    lines: Dict[str, int] = {}
    for module, path in MODULES.items():
        parts = _short(module).split(".")
        if parts[0] == "bench":
            continue
        top = module == PACKAGE or (len(parts) == 1 and path.name != "__init__.py")
        folder = "(top level)" if top else parts[0]
        lines[folder] = lines.get(folder, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    over = {folder: f"{100 * n / total:.1f} %" for folder, n in lines.items() if folder != "(top level)" and n > total / 5}
    assert not over, f"folders over a fifth of the package's lines: {over}"


def test_every_module_opens_with_a_line_on_its_role():
    missing = [_short(name) for name, path in MODULES.items()
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert not missing, f"modules without a docstring saying what they are for: {missing}"
