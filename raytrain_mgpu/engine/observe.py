"""What the engine measures beside training, on every rank of every transport: the FLOPs of one step and the
epoch's MFU, the profiler's window (``TrainConfig.profile_steps``), evaluation every N steps
(``eval_every_n_steps``).

- FLOPs: counted once per attempt by rank 0 on a ``meta`` copy of the model as built (before any wrapping or
  sharding), with the shapes of a few rows of its first batch (``engine/flops.step_flops``: no arithmetic, no
  read of the dataset of its own), then scaled to the global batch: the whole model's forward and backward
  over every replica's samples of one optimizer step. The epoch's
  ``mfu`` is those FLOPs times its steps over its time in steps and the devices' dense peak
  (``engine/flops.peak_flops_per_s``: a table of GPUs; None on CPU, under emulation or on an unknown GPU).
- The profiler: ``torch.profiler`` over the global steps ``profile_steps`` (``engine/profiling.StepProfiler``),
  one trace per rank, copied into ``<run>/profile`` when the run ends (TensorBoard's profiler plugin and
  Perfetto open it).
- Evaluation every N steps: the validation split (else the test split), its loss and metrics sent as per-step
  scalars (``val/loss``, ``val/accuracy``); its time is the epoch's ``eval_s``, not training.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Optional

import torch

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.engine import flops  # by module: tests replace flops.peak_flops_per_s
from raytrain_mgpu.engine.batches import head
from raytrain_mgpu.engine.profiling import StepProfiler

logger = logging.getLogger(__name__)

__all__ = ["Observer"]

_FLOP_SAMPLES = 4  # samples the FLOPs are counted on (they grow linearly with the batch)


class Observer:
    """One rank's measurements beside training (see the module docstring)."""

    def __init__(self, engine, model: torch.nn.Module):
        self.engine = engine
        cfg, steps = engine.cfg, engine.steps
        self.flops_per_step: Optional[float] = None
        self._model = self._meta_copy(model) if engine.rank == 0 else None  # counted on the first batch
        self.peak = flops.peak_flops_per_s(steps.device, cfg.precision)
        self.devices = engine.world * len(steps.memory_devices())
        self.profiler = None
        self._trace_dir: Optional[str] = None

    @staticmethod
    def _meta_copy(model: torch.nn.Module) -> Optional[torch.nn.Module]:
        try:
            return flops.meta_copy(model)
        except Exception as exc:  # a model that cannot be copied: no MFU column
            logger.debug("no meta copy of the model for its FLOPs: %s", exc)
            return None

    def first_batch(self, x, y) -> None:
        """Rank 0's first batch of the attempt: the FLOPs of a step, on a few of its rows' shapes (once)."""
        model, self._model = self._model, None
        if model is None:
            return
        engine = self.engine
        try:
            rows = min(_FLOP_SAMPLES, engine.plan.micro_batch)
            x, y = head(x, rows), head(y, rows)
            per_row = flops.step_flops(model, x, y, engine.steps.objective.loss) / rows
            self.flops_per_step = per_row * engine.plan.global_batch
        except Exception as exc:  # a model FlopCounterMode cannot run on meta: no MFU column
            logger.debug("FLOPs of a step not counted: %s", exc)

    def start(self, step: int) -> None:
        """Just before the first step of an attempt (``step`` steps already taken): the profiler's window."""
        window = self.engine.cfg.profile_steps
        if window is None or step >= window[1]:
            return
        self._trace_dir = tempfile.mkdtemp(prefix="raytrain-mgpu-profile-")
        self.profiler = StepProfiler(self._trace_dir, self.engine.rank, window[0], window[1],
                                     self.engine.steps.device.type, current_step=step)

    def after_step(self, step: int, meter) -> None:
        if self.profiler is not None:
            self.profiler.after_step(step)
        every = self.engine.cfg.eval_every_n_steps
        if every is not None and step % every == 0:
            self._evaluate(step, meter)

    def _evaluate(self, step: int, meter) -> None:
        engine = self.engine
        started = time.perf_counter()
        split = "val" if "val" in engine.feed.eval_loaders else "test"
        columns = engine.evaluate(split)  # every rank: a collective
        meter.eval_s += time.perf_counter() - started
        if engine.reporter is not None:
            engine.reporter.scalars(step, {f"{split}/{key[len(split) + 1:]}": value for key, value in columns.items()
                                           if value is not None})

    def columns(self, steps: int, training_s: float) -> dict:
        """The epoch row's ``flops_per_step`` and ``mfu`` (None where not counted, or no peak is known)."""
        if self.flops_per_step is None:
            return {"flops_per_step": None, "mfu": None}
        return {"flops_per_step": self.flops_per_step,
                "mfu": flops.mfu(self.flops_per_step, steps, training_s, self.peak, self.devices)}

    def close(self) -> None:
        """The run's end (or failure): a trace still recording is written, and every trace goes to ``<run>/profile``."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        try:
            profiler.close()
            files = [f for f in os.listdir(self._trace_dir) if f.endswith(".json")]
            if files:
                folder = RunFolder.of(self.engine.cfg)
                with folder.writable(folder.join("profile")) as target:
                    for name in files:
                        shutil.copyfile(os.path.join(self._trace_dir, name), os.path.join(target, name))
        except Exception:  # a trace that cannot be written never fails the run
            logger.warning("the profiler's trace could not be written", exc_info=True)
        finally:
            shutil.rmtree(self._trace_dir, ignore_errors=True)
