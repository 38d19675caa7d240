"""Where knowledge lives: a strategy is one class behind one interface, and nothing else names it.

What makes a strategy what it is (layout, memory model, the options it
reads) lives in its class under ``raytrain_mgpu/strategies/``; ``auto``, ``memory``,
``compare``, the runners and the benchmarks ask the class (or the run plan) instead of
branching on its name. Adding a strategy is one file and one registry line. Pure: no Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu import strategies
from raytrain_mgpu.planning import auto, memory
from raytrain_mgpu.planning.auto import ClusterInfo, choose_strategy, plan_config
from raytrain_mgpu.strategies.plan import build_plan
from raytrain_mgpu.strategies import STRATEGIES, Strategy
from raytrain_mgpu.strategies.base import PLACEMENT_STEPS, REPLICATION_STEPS
from raytrain_mgpu.strategies.ddp import DDPStrategy

SOURCE = Path(__file__).resolve().parents[1] / "raytrain_mgpu"

# (module path relative to the package, the string): places a strategy's name may stand, and why.
ALLOWED = {
    # The field's default value, not a branch: a config with no strategy runs ddp.
    ("config/train.py", "ddp"),
    # A benchmark of the pipeline runner configures that strategy, as a user's config does:
    # a keyword value passed to TrainConfig, not a branch on it.
    ("bench/pipeline.py", "pipeline"),
    # The lost-worker benchmark configures the one strategy replica groups run with, as a user's config does.
    ("bench/lost_worker.py", "ddp"),
}


def _docstrings(tree: ast.AST) -> Set[int]:
    """ids of the string constants that are docstrings: every bare string expression statement
    (module, class and function docstrings, and config/train.py's attribute docstrings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def _modules_outside_strategies() -> Iterator[Path]:
    for path in sorted(SOURCE.rglob("*.py")):
        if path.relative_to(SOURCE).parts[0] != "strategies":
            yield path


def _named_strategies(path: Path, names: Set[str], root: Path = SOURCE) -> List[Tuple[str, int, str]]:
    """``(module, line, name)`` for every string constant equal to one of ``names``, docstrings aside."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    where = path.relative_to(root).as_posix()
    return [(where, node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in docs]


def test_no_module_outside_strategies_names_a_strategy():
    names = set(STRATEGIES) - {"auto"}
    assert len(names) >= 9 and "auto" not in STRATEGIES  # the scan looks for the registered names
    found = [hit for path in _modules_outside_strategies() for hit in _named_strategies(path, names)]
    offending = [f"{where}:{line}: {value!r}" for where, line, value in found if (where, value) not in ALLOWED]
    assert not offending, ("strategy names outside raytrain_mgpu/strategies/ (ask the strategy class or the run "
                           "plan instead: what makes a strategy what it is lives in its class):\n" + "\n".join(offending))
    used = {(where, value) for where, _, value in found}
    assert not ALLOWED - used, f"allow-list entries no longer needed: {sorted(ALLOWED - used)}"


def test_the_scan_sees_a_branch_on_a_name_and_skips_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Uses ddp."""\n\ndef f(cfg):\n    """ddp"""\n    return cfg.strategy == "ddp"\n')
    assert _named_strategies(module, {"ddp"}, tmp_path) == [("m.py", 5, "ddp")]


# ----------------------------------------------------------------------------- a new strategy


class TinyDDPStrategy(DDPStrategy):
    """A user's strategy: DDP under another name, nothing else written."""

    name = "tiny_ddp"


@pytest.fixture
def tiny_registered(monkeypatch):
    monkeypatch.setitem(STRATEGIES, TinyDDPStrategy.name, TinyDDPStrategy)
    return TinyDDPStrategy.name


def test_a_new_strategy_is_one_class_and_one_registry_line(tiny_registered):
    name = tiny_registered
    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [32, 32]}, dataset="digits", batch_size=120)
    info = ClusterInfo((8,), True, 80 * 2**30)
    # auto's layout: the class's (inherited) rule, no edit in planning/.
    planned = plan_config(cfg, name, info)
    assert (planned.strategy, planned.num_workers) == (name, 8)
    # The memory estimate: the class's model, through planning.memory.
    profile = memory.profile_config(cfg)
    devices = memory.device_memory(name, planned, profile)
    assert devices == memory.device_memory("ddp", plan_config(cfg, "ddp", info), profile)
    assert memory.max_batch_within_budget(name, planned, profile, 80 * 2**30) >= cfg.batch_size
    # The run plan.
    plan = build_plan(planned, train_split_size=1437)
    assert (plan.strategy, plan.replicas, plan.micro_batch, plan.num_processes) == (name, 8, 15, 8)
    assert plan.steps_per_epoch == 1437 // 8 // 15
    # auto ranks it with ddp (inherited); the registry's order keeps ddp first.
    assert auto.candidates(info)[0] == "ddp" and name in auto.candidates(info)
    assert choose_strategy(cfg, info, profile=profile)[0] == "ddp"
    assert strategies.get_strategy(name) is TinyDDPStrategy


class BareStrategy(Strategy):  # no planning overrides at all: the default steps (device, then ddp)
    name = "bare"


def test_a_strategy_without_planning_rules_runs_as_configured_and_has_no_estimate(monkeypatch):
    monkeypatch.setitem(STRATEGIES, BareStrategy.name, BareStrategy)
    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [32, 32]}, dataset="digits", batch_size=120,
                          num_workers=3)
    planned = plan_config(cfg, "bare", ClusterInfo((8,), True, 80 * 2**30))
    assert (planned.strategy, planned.num_workers) == ("bare", 3)  # auto: run it as configured
    assert "bare" not in auto.candidates(ClusterInfo((8,), True), measured=True)  # auto never picks it
    with pytest.raises(ValueError, match=r"no memory model for strategy 'bare'; estimates exist for ddp, dp, "
                                         r"dp_balanced, mp, ddp_mp, ddp2, fsdp, pipeline and ddp_pipeline\."):
        memory.device_memory("bare", planned, memory.profile_config(cfg))


# ----------------------------------------------------------------------------- the worker side


def test_every_strategy_is_two_named_steps_on_the_worker_or_its_own_runner():
    """A strategy class names its worker's placement and replication (``parallel/``); the
    ``dp``/``mp`` family shares those steps instead of each wrapping the model its own way."""
    from raytrain_mgpu.parallel import PLACEMENTS, REPLICATIONS, build_worker
    from raytrain_mgpu.strategies import WorkerContext

    steps = {name: (cls.placement, cls.replication) for name, cls in STRATEGIES.items()
             if cls.runner == "train_workers"}
    assert steps == {"ddp": ("device", "replicate"), "dp": ("data_parallel", "none"),
                     "dp_balanced": ("balanced", "none"), "mp": ("split", "none"),
                     "ddp_mp": ("split", "replicate"), "ddp2": ("data_parallel", "replicate"),
                     "fsdp": ("keep", "fully_shard")}
    assert {p for p, _ in steps.values()} == set(PLACEMENTS) and {r for _, r in steps.values()} == set(REPLICATIONS)
    ctx = WorkerContext(0, 1, 0, 1, 0, ("cpu",))
    cfg = rtm.TrainConfig().parallel
    assert repr(build_worker(STRATEGIES["ddp2"], cfg, ctx)) == "DataParallelSteps('ddp2': data_parallel, then replicate)"
    with pytest.raises(RuntimeError, match="runs in its own actor group"):
        build_worker(STRATEGIES["pipeline"], cfg, ctx)

    # The driver knows the step names without torch; they are exactly the worker side's.
    assert PLACEMENT_STEPS == tuple(PLACEMENTS) and REPLICATION_STEPS == tuple(REPLICATIONS)
    # A class naming an unknown step fails where it is defined, on the driver, not on a worker.
    with pytest.raises(TypeError, match=r"strategy class Misnamed sets placement='gpu', which is not one of device, "
                                        r"keep, data_parallel, balanced, split\. Set placement to one of them"):
        class Misnamed(DDPStrategy):
            name, placement = "misnamed", "gpu"
    with pytest.raises(TypeError, match=r"sets replication='ddp', which is not one of none, replicate, fully_shard"):
        class Misreplicated(DDPStrategy):
            name, replication = "misreplicated", "ddp"
