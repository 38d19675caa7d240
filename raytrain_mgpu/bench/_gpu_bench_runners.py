"""The runners of ``raytrain-mgpu bench-gpu`` (``gpu_bench.py``): one model trained by a plain PyTorch loop,
by ``fit`` and by Lightning's ``Trainer``, each timed per epoch in the same way, from the same data and
initial weights.

The data (:func:`bench_data`) is generated at once and held as tensors, so loading is indexing and
collating in every runner; ``fit`` receives it as its ``TrainConfig.dataset`` (a factory of the
``DataConfig``), built again in its worker. Each runner returns a :class:`Measured`: the samples
(images or tokens) and seconds in steps of each epoch, an epoch ending when the GPU is done.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

from raytrain_mgpu.models.checkpointing import compiled

__all__ = ["Workload", "Options", "Measured", "bench_data", "run_plain", "run_fit", "run_lightning",
           "lightning_module"]


@dataclass(frozen=True)
class Workload:
    """One model with its data, batch and optimizer, as every runner trains it."""

    name: str
    label: str
    unit: str  # what a sample is: "images", "tokens"
    model: str  # TrainConfig.model
    model_kwargs: dict
    input_shape: tuple
    num_classes: int
    samples: int  # training samples (images, sequences) an epoch
    batch: int
    optimizer: str  # TrainConfig.optimizer: "sgd" (momentum 0.9) or "adamw"
    lr: float

    def build(self) -> torch.nn.Module:
        from raytrain_mgpu.models import build_model

        return build_model(self.model, self.input_shape, self.num_classes, self.model_kwargs)

    def optimizer_for(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":  # fit's sgd and adamw (raytrain_mgpu/engine/optim.py): the same steps
            return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=self.lr)

    @property
    def step_samples(self) -> int:
        """Samples a step: the batch's images, or its tokens."""
        return self.batch * (self.input_shape[0] if self.unit == "tokens" else 1)

    def data(self):
        return bench_data(SimpleNamespace(input_shape=self.input_shape, num_classes=self.num_classes,
                                          num_samples=self.samples, seed=0))


def bench_data(cfg):
    """The benchmark's data, generated at once and held as tensors (``TrainConfig.dataset`` for ``fit``; a
    factory of ``cfg``'s ``input_shape``, ``num_classes``, ``num_samples`` and ``seed``): images as ``synthetic``
    makes them (a class prototype plus noise), or token sequences from ``synthetic_text``'s Markov chain."""
    from torch.utils.data import TensorDataset

    from raytrain_mgpu.data.base import Datasets
    from raytrain_mgpu.data.text import markov_streams

    shape, classes, train = tuple(cfg.input_shape), cfg.num_classes, cfg.num_samples
    total = train + max(4, min(train // 4, 1024))  # a small test split: fit evaluates it once, at the end
    generator = torch.Generator().manual_seed(cfg.seed)
    if len(shape) == 1:  # token sequences: x and y, y shifted by one
        tokens = torch.from_numpy(markov_streams(total, shape[0] + 1, classes, cfg.seed, 0))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        prototypes = torch.randn((classes, *shape), generator=generator)
        y = torch.randint(classes, (total,), generator=generator)
        x = (prototypes[y] + torch.randn((total, *shape), generator=generator)) * (1 / math.sqrt(2))
    return Datasets(TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:]), shape, classes)


@dataclass(frozen=True)
class Options:
    """What every runner applies alike (fit: the TrainConfig fields of the same names)."""

    compile: Union[bool, str] = False  # TrainConfig.compile's values: False, True (whole model) or "blocks"
    channels_last: bool = False
    loader_workers: int = 0
    threads: int = 1  # torch threads (fit: cpus_per_worker)


@dataclass
class Measured:
    """One runner's run: samples (images or tokens) and seconds in steps, per epoch."""

    model: str
    precision: str
    runner: str
    samples: List[int]
    seconds: List[float]
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def steady(self) -> tuple:
        """``(samples, seconds)`` over the epochs after the first (or the only one)."""
        samples, seconds = self.samples[1:] or self.samples, self.seconds[1:] or self.seconds
        return sum(samples), sum(seconds)

    @property
    def samples_per_s(self) -> float:
        samples, seconds = self.steady
        return samples / max(seconds, 1e-9)


# ----------------------------------------------------------------------------- runners


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an epoch ends when the GPU is done


def _loader(dataset, work: Workload, device: torch.device, options: Options):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=work.batch, shuffle=True, drop_last=True,
                      pin_memory=device.type == "cuda", num_workers=options.loader_workers,
                      persistent_workers=options.loader_workers > 0)


def _prepared(model: torch.nn.Module, device: torch.device, options: Options) -> torch.nn.Module:
    model = model.to(device, memory_format=torch.channels_last) if options.channels_last else model.to(device)
    return compiled(model, options.compile)


def run_plain(work: Workload, precision: str, device: torch.device, epochs: int, options: Options,
              profile_dir: Optional[str] = None) -> Measured:
    """The baseline: a plain loop; with ``profile_dir``, a trace of 3 more steps after the timed epochs."""
    torch.manual_seed(0)
    model = _prepared(work.build(), device, options)
    optimizer = work.optimizer_for(model)
    loader = _loader(work.data().train, work, device, options)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)

    def step(x, y) -> int:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if options.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return y.numel()  # from the shape: no host-device sync

    measured = Measured(work.name, precision, "plain", [], [])
    for _ in range(epochs):
        start, samples = time.perf_counter(), 0
        for x, y in loader:
            samples += step(x, y)
        _sync(device)
        measured.samples.append(samples)
        measured.seconds.append(time.perf_counter() - start)
    if profile_dir:
        measured.extra["trace"] = _trace(step, loader, os.path.join(profile_dir, f"{work.name}-{precision}"), device)
    return measured


def _trace(step: Callable, loader, out_dir: str, device: torch.device) -> Optional[str]:
    from raytrain_mgpu.engine.profiling import StepProfiler

    profiler = StepProfiler(out_dir, 0, first_step=2, last_step=4, device_type=device.type)  # step 1: warm-up
    try:
        for number, (x, y) in enumerate(loader, 1):
            step(x, y)
            profiler.after_step(number)
            if number == 4:
                break
    finally:
        profiler.close()
    return profiler.trace_path


def run_fit(work: Workload, precision: str, device: torch.device, epochs: int, options: Options, storage: str,
            runner: str = "auto") -> Measured:
    """``fit`` with one worker (strategy ddp) on ``device``; its history rows give samples and seconds in steps.

    ``runner`` is ``TrainConfig.runner``: ``"auto"`` trains one worker in this process (no Ray), ``"ray"`` on a
    Ray Train worker; the row's runner is ``fit`` or ``fit-ray``."""
    from raytrain_mgpu.api import fit
    from raytrain_mgpu.config.train import TrainConfig

    label = "fit" if runner == "auto" else f"fit-{runner}"
    cfg = TrainConfig(model=work.model, model_kwargs=work.model_kwargs, dataset=bench_data,
                      input_shape=work.input_shape, num_classes=work.num_classes, num_samples=work.samples,
                      batch_size=work.batch, epochs=epochs, optimizer=work.optimizer, lr=work.lr, momentum=0.9,
                      precision=precision, compile=options.compile, channels_last=options.channels_last,
                      loader_workers=options.loader_workers, num_workers=1, runner=runner,
                      use_gpu=device.type == "cuda", cpus_per_worker=options.threads, eval_every_epochs=100,
                      storage_path=storage, name=f"bench-gpu-{work.name}-{precision}-{label}", seed=0)
    with open(os.devnull, "w") as quiet:
        rows = fit(cfg, stream=quiet).history
    return Measured(work.name, precision, label, [round(r["samples_per_s"] * r["training_s"]) for r in rows],
                    [r["training_s"] for r in rows])


def lightning_module():
    """``lightning.pytorch`` or ``pytorch_lightning``, whichever is installed; None if neither is."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return importlib.import_module(name)
    return None


def run_lightning(work: Workload, precision: str, device: torch.device, epochs: int, options: Options) -> Measured:
    """Lightning's ``Trainer`` on one device; a callback times each epoch (synchronised) and counts its samples."""
    pl = lightning_module()
    logging.getLogger(pl.__name__).setLevel(logging.WARNING)  # its "GPU available: ..." lines, set on its import
    measured = Measured(work.name, precision, "lightning", [], [])

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = work.build()
            if options.channels_last:
                self.model = self.model.to(memory_format=torch.channels_last)
            self.model = compiled(self.model, options.compile)

        def training_step(self, batch, index):
            x, y = batch
            if options.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return work.optimizer_for(self.model)

    class EpochTimer(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            _sync(device)
            self.start, self.samples = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.samples += batch[1].numel()

        def on_train_epoch_end(self, trainer, module):
            _sync(device)
            measured.samples.append(self.samples)
            measured.seconds.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    module = Module()
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=epochs,
                         precision={"32": "32-true"}.get(precision, precision), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[EpochTimer()])
    with warnings.catch_warnings():  # "the dataloader does not have many workers", and the like
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=_loader(work.data().train, work, device, options))
    return measured
