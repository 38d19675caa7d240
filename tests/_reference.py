"""What a 1-worker ``fit`` trains, computed in the test's own process, without Ray.

Tests whose point is the numbers ("a run through faults, on two nodes, or an elastic group ends with
the undisturbed run's weights") compare with this instead of a second run through Ray: the parts of
``runtime/loop.py``'s ``train_worker`` on one rank (the model built on the seed, the resumable
sampler, the loader, ``_Loop`` and its accumulation), no worker group to start. A fit through Ray
ends with exactly these weights: tests/test_loaders.py checks it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Optional

import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.objectives import Objective
from raytrain_mgpu.optim import build_optimizer, build_scheduler
from raytrain_mgpu.runtime import loop as loop_module
from raytrain_mgpu.runtime.loaders import prefetch, train_loader
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.runtime.run_state import RunState
from raytrain_mgpu.runtime.step_checkpoints import ResumableSampler
from raytrain_mgpu.strategies import WorkerContext, get_strategy

CPU = torch.device("cpu")
_CACHE: dict = {}


@contextlib.contextmanager
def _no_ray():
    """The loop's per-epoch device record asks Ray for GPU ids and the node: nothing to ask here."""
    saved, loop_module._device_record = loop_module._device_record, lambda ctx: {}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        loop_module._device_record = saved
        torch.set_num_threads(threads)


def train_one_worker(fields: dict, epochs: Optional[int] = None, start: int = 0, restored=None) -> tuple:
    """``(weights, optimizer state, rng state, history)`` after epochs ``start``..``epochs`` of ``fields``
    on one rank; ``restored``: the first three of an earlier call, as a resumed worker loads them."""
    cfg = rtm.TrainConfig(**fields)
    epochs = cfg.epochs if epochs is None else epochs
    with _no_ray():
        torch.set_num_threads(cfg.cpus_per_worker)
        data = build_datasets(cfg.data)
        strategy = get_strategy(cfg.strategy)(cfg.parallel, WorkerContext(0, 1, 0, 1, 0, (CPU,)),
                                              Objective.of(cfg, data.num_classes))
        model = strategy.setup_model(loop_module._build_model(cfg, strategy, data.input_shape, data.num_classes))
        accum = cfg.grad_accum_steps
        sampler = ResumableSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
        loader = train_loader(cfg.data, data.train, sampler, cfg.batch_size // accum, CPU)
        steps_per_epoch = len(loader) // accum
        optimizer = build_optimizer(model.parameters(), cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.epochs)
        if restored is not None:  # as a resumed worker: weights, optimizer and its random stream
            model.load_state_dict(restored[0])
            optimizer.load_state_dict(restored[1])
            torch.set_rng_state(restored[2])
        loop = loop_module._Loop(cfg, strategy, model, optimizer, scheduler,
                                 torch.amp.GradScaler("cpu", enabled=False), loader, WorkerReporter(None),
                                 steps_per_epoch)
        loop.accum_steps = accum
        state, history = RunState(), []
        for epoch in range(start, epochs):
            sampler.set_epoch(epoch)
            prefetch(data.train, sampler)
            history.append(loop.train_epoch(epoch, state))
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return weights, optimizer.state_dict(), torch.get_rng_state(), history


def one_worker_weights(**fields) -> dict:
    """The final weights of a 1-worker run of ``fields`` (computed once per distinct config in a session)."""
    key = json.dumps(fields, sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = train_one_worker(fields)[0]
    return {k: v.clone() for k, v in _CACHE[key].items()}
