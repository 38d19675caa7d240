"""What a 1-worker ``fit`` trains, computed in the test's own process, without Ray.

Tests whose point is the numbers ("a run through faults, on two nodes, or an elastic group ends with
the undisturbed run's weights") compare with this instead of a second run through Ray: the in-process
runner (``runner="local"``), which runs the engine every Ray Train worker runs, with world size 1; a fit
through Ray ends with exactly these weights (tests/test_local_runner.py). ``train_replicas`` emulates 2
``ddp`` replicas by hand in this process (bit for bit a 2-worker fit's weights).
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace
from typing import Optional

import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.optim import build_optimizer, build_scheduler
from raytrain_mgpu.engine.loaders import test_loader, train_loader
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.engine.run_state import eval_columns, metric_columns
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

CPU = torch.device("cpu")
_CACHE: dict = {}


def train_one_worker(fields: dict, epochs: Optional[int] = None, storage: Optional[str] = None) -> tuple:
    """``(weights, optimizer state, rng state, history)`` after ``epochs`` (default ``fields``') of ``fields`` on one
    worker: the in-process runner (``runner="local"``: the engine a Ray Train worker runs, in this process, with
    world size 1), its run folder under ``storage`` (a temporary folder by default; a second call with the same
    ``storage`` and more ``epochs`` resumes). A strategy that shards (``fsdp``) is its ``ddp`` twin here: one
    worker holds the whole model either way, and the arithmetic is the plain model's."""
    import io
    import tempfile

    from raytrain_mgpu.checkpointing.files import load_train_state, local_checkpoint
    from raytrain_mgpu.strategies import get_strategy

    fields = {"use_gpu": False, **fields, "num_workers": 1, "runner": "local"}
    if epochs is not None:
        fields["epochs"] = epochs
    if get_strategy(fields.get("strategy", "ddp")).replication == "fully_shard":
        fields = {key: value for key, value in fields.items() if key not in ("shard_group_size", "cpu_offload")}
        fields["strategy"] = "ddp"
    storage = storage or tempfile.mkdtemp(prefix="reference-")
    threads = torch.get_num_threads()
    try:
        result = rtm.fit(rtm.TrainConfig(**{**fields, "storage_path": storage, "name": "reference"}),
                         stream=io.StringIO())
    finally:
        torch.set_num_threads(threads)
    with local_checkpoint(result.checkpoint_path) as directory:
        train_state = load_train_state(directory)
    weights = {k: v.detach().clone() for k, v in result.load_model().state_dict().items()}
    return weights, train_state["optimizer"], train_state["rng_per_rank"][0]["cpu"], result.history


@contextlib.contextmanager
def steps_trained():
    """The global steps the engine takes in this process meanwhile (``engine/loop.STEP_EVENTS``), in order: a
    resumed in-process run's are those after its checkpoint only."""
    from raytrain_mgpu.engine import loop as engine

    steps: list = []
    record = steps.append
    engine.STEP_EVENTS.append(record)
    try:
        yield steps
    finally:
        engine.STEP_EVENTS.remove(record)


def one_worker_weights(**fields) -> dict:
    """The final weights of a 1-worker run of ``fields`` (computed once per distinct config in a session)."""
    key = json.dumps(fields, sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = train_one_worker(fields)[0]
    return {k: v.clone() for k, v in _CACHE[key].items()}


def plain_weights(cfg, batches, input_shape: tuple, num_classes: int) -> dict:
    """``cfg``'s model (seeded as a run) after one optimizer step on each ``(x, y)`` of ``batches`` in this process,
    cross-entropy on the whole batch: what a data- or tensor-parallel group of ranks must end with."""
    from torch.nn import functional as F

    from raytrain_mgpu.models import build_model

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def build_rank_model(cfg, strategy, input_shape, num_classes):
    """The engine's initial model (``engine/checkpoints.build_model``) for ``strategy``'s rank."""
    from raytrain_mgpu.checkpointing.contents import build_model

    class _Rank:
        ctx = strategy.ctx

        @staticmethod
        def build_on_meta():
            return strategy.build_on_meta()

    return build_model(cfg, _Rank(), SimpleNamespace(input_shape=input_shape, num_classes=num_classes))


def _replica(cfg, data, rank: int, world: int, micro_batch: int):
    """Rank ``rank``'s strategy, plain model (the same initial weights on every rank), sampler and loader."""
    strategy = build_worker(get_strategy(cfg.strategy), cfg.parallel,
                            WorkerContext(rank, world, rank, world, 0, (CPU,)), Objective.of(cfg, data.num_classes))
    model = build_rank_model(cfg, strategy, data.input_shape, data.num_classes).to(CPU)
    sampler = ResumableSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    return strategy, model, sampler, train_loader(cfg.data, data.train, sampler, micro_batch, CPU)


def _sum_over_ranks(meters) -> list:
    """What ``all_reduce_sum`` gives for 2 ranks: each float64 slot added (a + b = b + a: gloo's order is moot)."""
    total = meters[0].totals
    for meter in meters[1:]:
        total = total + meter.totals
    return total.tolist()


def _evaluate(cfg, data, strategies, models, replica_batch: int) -> dict:
    """``_Loop.evaluate`` on every rank's disjoint shard of the test split, the sums added over ranks."""
    meters = []
    with torch.no_grad():
        for rank, (strategy, model) in enumerate(zip(strategies, models)):
            model.eval()
            meter = EpochMeter(CPU, strategy.objective)
            for x, y in test_loader(cfg.data, data.test, rank, len(models), replica_batch, CPU):
                loss, outputs = strategy.placement.compute_loss(strategy, model, x, y)
                meter.add(loss.float(), outputs, y)
            meters.append(meter)
    return eval_columns(*meters[0].split(_sum_over_ranks(meters)))


def train_replicas(fields: dict, world: int = 2) -> tuple:
    """``(weights, history)`` of ``fields`` trained by ``world`` ddp replicas, emulated in this process.

    Each rank's plain model takes its sampler shard's micro-batches (accumulated as ``_Loop`` does);
    then every gradient becomes what DDP's reducer leaves after gloo's all-reduce (each rank's
    times 1/world, summed) and every rank steps its own optimizer. With 2 ranks this is bit for bit
    what a 2-worker ``fit`` trains (sums of two are one order); its history rows hold the all-reduced
    epoch sums (``epoch``, ``step``, ``train_loss``, ``train_accuracy`` and, on evaluated epochs,
    ``test_*``). Models that draw random numbers while training (dropout) would share this process's
    one stream: not emulated; neither are grad clipping, mixed precision or step checkpoints' resume.
    """
    cfg = rtm.TrainConfig(**{"use_gpu": False, **fields})
    if cfg.strategy != "ddp" or cfg.grad_clip_norm is not None or cfg.precision != "32":
        raise ValueError("train_replicas emulates plain ddp in fp32 without clipping")
    accum = cfg.grad_accum_steps
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cfg.cpus_per_worker)
        data = build_datasets(cfg.data)
        ranks = [_replica(cfg, data, rank, world, cfg.batch_size // (world * accum)) for rank in range(world)]
        strategies, models, samplers, loaders = (list(part) for part in zip(*ranks))
        steps_per_epoch = len(loaders[0]) // accum
        optimizers = [build_optimizer(model.parameters(), cfg.optim) for model in models]
        schedulers = [build_scheduler(opt, cfg.optim, steps_per_epoch, cfg.epochs) for opt in optimizers]
        history, step = [], 0
        for epoch in range(cfg.epochs):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            batches = [iter(loader) for loader in loaders]
            meters = [EpochMeter(CPU, strategy.objective) for strategy in strategies]
            for model in models:
                model.train()
            for _ in range(steps_per_epoch):
                for strategy, model, rank_batches, meter in zip(strategies, models, batches, meters):
                    for _ in range(accum):
                        x, y = next(rank_batches)
                        loss, outputs = strategy.placement.compute_loss(strategy, model, x, y)
                        (loss / accum).backward()
                        meter.add(loss, outputs, y)
                for params in zip(*(model.parameters() for model in models)):
                    reduced = params[0].grad * (1 / world)
                    for param in params[1:]:
                        reduced = reduced + param.grad * (1 / world)
                    for param in params:
                        param.grad = reduced.clone()
                for optimizer, scheduler in zip(optimizers, schedulers):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                step += 1
            loss_sum, samples, totals = meters[0].split(_sum_over_ranks(meters))
            row = {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / max(samples, 1),
                   **metric_columns("train", totals)}
            if (epoch + 1) % cfg.eval_every_epochs == 0 or epoch + 1 == cfg.epochs:
                row.update(_evaluate(cfg, data, strategies, models, cfg.batch_size // world))
            history.append(row)
        return {k: v.detach().clone() for k, v in models[0].state_dict().items()}, history
    finally:
        torch.set_num_threads(threads)


def evaluate(fields: dict, weights: dict) -> dict:
    """``test_loss`` and ``test_<metric>`` of ``weights`` as a 1-worker ``fit`` of ``fields`` evaluates them."""
    cfg = rtm.TrainConfig(**{"use_gpu": False, **fields})
    data = build_datasets(cfg.data)
    strategy, model, _, _ = _replica(cfg, data, 0, 1, cfg.batch_size)
    model.load_state_dict(weights)
    return _evaluate(cfg, data, [strategy], [model], cfg.batch_size)
