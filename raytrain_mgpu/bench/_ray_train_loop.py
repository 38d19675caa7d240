"""The benchmarks' baseline: what a Ray Train user writes (Ray Train's "Get started with PyTorch"), with this
package's data and model, so that only the loop around them differs from ``fit``'s.

``TorchTrainer(hand_written_loop, train_loop_config={"cfg": cfg.to_dict(), "out": path})``: per epoch, DDP
steps over ``prepare_data_loader``'s ``DistributedSampler`` (its epoch set), then rank 0 saves the model
(``torch.save``) and every rank reports with that checkpoint, as ``fit`` checkpoints every epoch. The same
optimizer steps as ``fit``'s ``sgd`` and torch threads as its workers (``cpus_per_worker``).

With ``out``, rank 0 appends JSON lines there: ``{"first_step": time.time()}`` as its first step begins
(``bench-startup``), then ``{"training_s": ..., "samples": ...}`` after each epoch (``bench --short-epochs``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time


def hand_written_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch
    from torch.utils.data import DataLoader

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.models import build_model

    cfg = TrainConfig.from_dict(config["cfg"])
    torch.set_num_threads(cfg.cpus_per_worker)
    world, rank = ray.train.get_context().get_world_size(), ray.train.get_context().get_world_rank()

    def write(row: dict) -> None:
        if rank == 0 and "out" in config:
            with open(config["out"], "a") as out:
                out.write(json.dumps(row) + "\n")

    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = ray.train.torch.prepare_model(build_model(cfg.model, data.input_shape, data.num_classes,
                                                      cfg.model_kwargs))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(data.train, batch_size=cfg.batch_size // world, shuffle=True, drop_last=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # fit's sgd: the same steps
    first_step = True
    for epoch in range(cfg.epochs):
        if world > 1:
            loader.sampler.set_epoch(epoch)
        epoch_start, samples = time.perf_counter(), 0
        for x, y in loader:
            if first_step:
                write({"first_step": time.time()})
                first_step = False
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(y) * world
        write({"training_s": time.perf_counter() - epoch_start, "samples": samples})
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if rank == 0:
                torch.save(model.module.state_dict() if world > 1 else model.state_dict(),
                           os.path.join(directory, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({"epoch": epoch + 1, "loss": loss.item()}, checkpoint=checkpoint)
