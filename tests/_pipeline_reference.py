"""What an undisturbed pipeline run trains, computed in the test's own process, without Ray.

Tests whose point is that a disturbed run (killed, resumed) ends like an undisturbed one compare with
this instead of a second run through Ray (each costs ~15 s of start-up on a small machine). It does
the stage runners' arithmetic in the same order (``pipeline/steps.py`` and ``executor.py``): the
model built on the seed and cut by the same partition, each replica's loader on its share of the
epoch's order, every micro-batch's loss scaled by ``1 / m`` and the gradients accumulated in the
schedule's backward order, one stage's output passed to the next detached (as a message is), the
replicas' gradients summed and divided by their count, an optimizer per stage. So the weights are
bit for bit a run's (``tests/test_pipeline_ray.py`` and ``tests/test_pipeline_step_checkpoints.py``
check it against Ray runs), where ``tests/test_pipeline_equivalence.py``'s unsplit one-process model
only agrees to rounding. Scope: fp32, no gradient clipping, the default reader (no Ray Data).
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch

from raytrain_mgpu.engine.batches import detach, split
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.partition import build_stage_modules
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.optim import build_optimizer, build_scheduler
from raytrain_mgpu.pipeline.plan import choose_partition
from raytrain_mgpu.pipeline.schedule import BACKWARD, build_order
from raytrain_mgpu.pipeline.steps import microbatch_rows
from raytrain_mgpu.engine.loaders import prefetch, test_loader, train_loader
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.engine.run_state import eval_columns, metric_columns
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler
from raytrain_mgpu.strategies.plan import build_plan

CPU = torch.device("cpu")


@contextlib.contextmanager
def _threads(num: int):
    """A stage actor computes on ``cpus_per_worker`` threads: the same here, then back."""
    saved = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _backward_order(cfg: TrainConfig) -> List[int]:
    """The micro-batches in the order their backwards run, the same on every stage (checked)."""
    order = build_order(cfg.schedule, cfg.num_stages, cfg.num_microbatches)
    per_stage: dict = {}
    for actions in order:
        for stage, kind, mb in actions:
            if kind == BACKWARD:
                per_stage.setdefault(stage, []).append(mb)
    orders = {tuple(mbs) for mbs in per_stage.values()}
    assert len(orders) == 1, f"stages run their backwards in different orders: {per_stage}"
    return list(orders.pop())


def _forward(stages, x, y, objective: Objective, meter: EpochMeter, keep: bool):
    """One micro-batch through every stage; ``(loss, [(stage input, stage output)])`` for the backward."""
    links = []
    for index, stage in enumerate(stages):
        if index > 0:  # a message: the output detached, a leaf that takes the gradient
            x = x.detach().requires_grad_(keep and x.is_floating_point())
        out = stage(x)
        links.append((x, out))
        x = out
    loss = objective.loss(x, y)
    meter.add(loss.detach().float(), detach(x), y)
    return loss, links


def _backward(loss: torch.Tensor, links: list, scale: float) -> None:
    (loss * scale).backward()
    for index in range(len(links) - 1, 0, -1):  # each earlier stage from the gradient of its output
        torch.autograd.backward(links[index - 1][1], links[index][0].grad)


def _train_step(cfg, stages, replicas, objective, meters, order) -> None:
    """Every replica's micro-batches, then the replicas' mean gradient (their all-reduce)."""
    params = [p for stage in stages for p in stage.parameters()]
    grads = []
    for batches, meter in zip(replicas, meters):
        x, y = next(batches)
        xs, ys = split(x, cfg.num_microbatches), split(y, cfg.num_microbatches)
        forwards = [_forward(stages, xs[mb], ys[mb], objective, meter, keep=True) for mb in range(len(xs))]
        for mb in order:
            _backward(*forwards[mb], scale=1.0 / len(xs))
        if len(replicas) > 1:
            grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            for p in params:
                p.grad = None
    if len(replicas) > 1:  # gloo's sum of D tensors, then divided by D, per stage's flat buffer
        for p, *per_replica in zip(params, *grads):
            total = per_replica[0].clone()
            for g in per_replica[1:]:
                total += g
            p.grad = total / len(replicas)


def _evaluate(cfg, data, stages, objective, num_replicas: int, replica_batch: int) -> dict:
    sums = []
    for replica in range(num_replicas):
        meter = EpochMeter(CPU, objective)
        loader = test_loader(cfg.data, data.test, replica, num_replicas, replica_batch, CPU)
        size, bs, batches = len(loader.dataset), loader.batch_size, iter(loader)
        with torch.no_grad():
            for start in range(0, size, bs):
                chunks = len(microbatch_rows(min(bs, size - start), cfg.num_microbatches))
                x, y = next(batches)
                for xm, ym in zip(split(x, chunks), split(y, chunks)):
                    _forward(stages, xm, ym, objective, meter, keep=False)
        totals = StageTotals()
        totals.take(meter)
        sums.append(totals)
    return eval_columns(sum(t.loss_sum for t in sums), sum(t.targets for t in sums),
                        _add_metric_totals(t.metrics for t in sums))


def train_pipeline(cfg: TrainConfig) -> Tuple[dict, List[dict]]:
    """``(weights under the unsplit model's names, history rows)`` of an undisturbed run of ``cfg``; each row
    holds epoch, step, train_loss, train_accuracy, test_loss and test_accuracy (None where the run does not
    evaluate)."""
    plan = build_plan(cfg)
    D, b = plan.replicas, plan.replica_batch
    with _threads(cfg.cpus_per_worker):
        data = build_datasets(cfg.data)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
        stages = build_stage_modules(model, choose_partition(cfg, log=False))
        objective = Objective.of(cfg, data.num_classes)
        samplers = [ResumableSampler(data.train, num_replicas=D, rank=r, shuffle=True, seed=cfg.seed, drop_last=True)
                    for r in range(D)]
        loaders = [train_loader(cfg.data, data.train, sampler, b, CPU) for sampler in samplers]
        steps_per_epoch = len(data.train) // D // b
        optimizers = [build_optimizer(list(stage.parameters()), cfg.optim) for stage in stages]
        schedulers = [build_scheduler(opt, cfg.optim, steps_per_epoch, cfg.epochs) for opt in optimizers]
        order, history, step = _backward_order(cfg), [], 0
        for epoch in range(cfg.epochs):
            for sampler in samplers:
                sampler.set_epoch(epoch)
                prefetch(data.train, sampler)
            replicas, meters = [iter(loader) for loader in loaders], [EpochMeter(CPU, objective) for _ in range(D)]
            for stage in stages:
                stage.train()
            for _ in range(steps_per_epoch):
                _train_step(cfg, stages, replicas, objective, meters, order)
                for opt, sched in zip(optimizers, schedulers):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sched.step()
                step += 1
            totals = []
            for meter in meters:
                totals.append(StageTotals())
                totals[-1].take(meter)
            samples = sum(t.targets for t in totals)
            row = {"epoch": epoch + 1, "step": step, "train_loss": sum(t.loss_sum for t in totals) / max(samples, 1),
                   **metric_columns("train", _add_metric_totals(t.metrics for t in totals))}
            row.setdefault("train_accuracy", None)
            row.update(test_loss=None, test_accuracy=None)
            if epoch + 1 == cfg.epochs or (epoch + 1) % cfg.eval_every_epochs == 0:
                for stage in stages:
                    stage.eval()
                row.update(_evaluate(cfg, data, stages, objective, D, b))
            history.append(row)
        weights = {}
        for stage in stages:
            weights.update({k: v.detach().clone() for k, v in stage.model_state_dict().items()})
        return weights, history


def train_unsplit(cfg: TrainConfig) -> dict:
    """The unsplit model on the global batch for ``cfg.epochs``, read by ``engine/loaders.py``'s loader
    without loader workers (``cfg``'s transforms applied): what a pipeline run of ``cfg`` trains, up to the
    rounding of its micro-batches' sums (``rtol=1e-4``)."""
    from torch.utils.data import DistributedSampler

    with _threads(cfg.cpus_per_worker):
        data = build_datasets(cfg.data)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
        sampler = DistributedSampler(data.train, 1, 0, shuffle=True, seed=cfg.seed, drop_last=True)
        loader = train_loader(cfg.replace(loader_workers=0).data, data.train, sampler, cfg.batch_size, CPU)
        optimizer = build_optimizer(model.parameters(), cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, len(loader), cfg.epochs)
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        return model.state_dict()


def _add_metric_totals(parts) -> dict:
    """``{metric: [sum, count]}`` added over the replicas' totals."""
    added: dict = {}
    for part in parts:
        for name, (total, count) in part.items():
            previous = added.get(name, [0.0, 0.0])
            added[name] = [previous[0] + total, previous[1] + count]
    return added


class StageTotals:
    """One pipeline rank's sums for an epoch (host floats: the executor times its own steps).

    The last stage's loss and metric sums join them once an epoch (``take``), as ``loss_sum``,
    ``targets`` and ``metrics`` (``{name: [sum, count]}``); the driver adds them over replicas.
    """

    def __init__(self):
        self.steps, self.busy_s, self.schedule_s, self.step_s, self.data_wait_s, self.bytes_sent = 0, 0.0, 0.0, 0.0, 0.0, 0
        self.loss_sum, self.targets, self.metrics = 0.0, 0.0, {}

    def take(self, meter: EpochMeter) -> None:
        """The meter's sums (one device read: call once, at the end of the epoch)."""
        self.loss_sum, self.targets, pairs = meter.split(meter.totals.tolist())
        self.metrics = {name: list(pair) for name, pair in pairs.items()}

    def add_step(self, stats, step_s: float) -> None:
        """``stats``: the executor's ``busy_s``, ``wall_s`` and ``bytes_sent`` of one step."""
        self.steps += 1
        self.busy_s += stats.busy_s
        self.schedule_s += stats.wall_s
        self.bytes_sent += stats.bytes_sent
        self.step_s += step_s

    def as_dict(self) -> dict:
        return {"steps": self.steps, "busy_s": self.busy_s, "schedule_s": self.schedule_s, "step_s": self.step_s,
                "data_wait_s": self.data_wait_s, "bytes_sent": self.bytes_sent, "loss_sum": self.loss_sum,
                "targets": self.targets, "metrics": self.metrics}
