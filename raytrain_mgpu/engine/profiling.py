"""A trace of a window of training steps: where a step's time goes, on the host and on the GPU.

:class:`StepProfiler` runs ``torch.profiler`` over optimizer steps ``first_step..last_step`` (1-based
global steps, inclusive) and writes one trace per rank into ``out_dir``, named
``rank{rank}.<ns>.pt.trace.json`` (``torch.profiler.tensorboard_trace_handler``): TensorBoard's profiler
plugin reads the folder (``tensorboard --logdir out_dir``), and https://ui.perfetto.dev or
``chrome://tracing`` open a file. Each step is a ``ProfilerStep#N`` span, ``N`` the global step.

The step before the window runs under the profiler as its warm-up (torch's ``WARMUP``: the tracer is
started, nothing is kept), so the first step in the window does not carry the tracer's start-up.
Outside the window a step costs one integer comparison; in it, the profiler's own overhead (a few
microseconds an operator); at its end one CUDA synchronisation and writing the JSON (about a second
for a few steps of a ResNet, more with ``with_stack``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch

__all__ = ["StepProfiler"]

logger = logging.getLogger(__name__)

_NEVER = sys.maxsize


class StepProfiler:
    """Profiles optimizer steps ``first_step..last_step``; call :meth:`after_step` after every optimizer
    step with the global step just finished (1 after the first), and :meth:`close` when the run ends.

    Build it just before the first step: a window that starts at step 1 (or 2, with its warm-up) starts
    the profiler here. ``current_step`` is the global step the run starts from (a resumed run's restored
    step; 0 for a new run): a window it has passed is never profiled, one it is inside is profiled from
    the next step. ``device_type`` ``"cuda"`` adds CUDA activity (kernels, copies) to the CPU's.
    """

    def __init__(self, out_dir: str, rank: int, first_step: int, last_step: int, device_type: str,
                 with_stack: bool = False, current_step: int = 0):
        if not (isinstance(first_step, int) and isinstance(last_step, int) and 1 <= first_step <= last_step):
            raise ValueError(f"profile_steps=({first_step!r}, {last_step!r}): must be two global optimizer steps "
                             f"1 <= first <= last (1-based, both profiled), e.g. (10, 12).")
        self.out_dir, self.rank = out_dir, rank
        self.first_step, self.last_step = first_step, last_step
        self.device_type, self.with_stack = device_type, with_stack
        self.trace_path: Optional[str] = None
        """The file written, once it is."""
        self._profile: Optional[torch.profiler.profile] = None
        # The profiler starts after step first_step - 2 (the warm-up step first_step - 1 then runs under it).
        self._next = max(first_step - 2, 0)
        self._begin(current_step)

    def after_step(self, global_step: int) -> None:
        """After optimizer step ``global_step`` (1-based): starts, steps or stops the profiler when due."""
        if global_step < self._next:  # the whole cost outside the window
            return
        if self._profile is None:
            self._begin(global_step)
        else:
            self._advance(global_step)

    def close(self) -> None:
        """Stops a profile still running (the run ended inside the window) and writes what it recorded. Its
        last span, ``ProfilerStep#`` the step after the run's last, holds what the run did from its last
        step's end to this call (the epoch's end, evaluation, the last checkpoint)."""
        if self._profile is not None:
            if self._profile.step_num <= self.first_step:  # the run ended before the window's first step
                self._profile.on_trace_ready = None  # nothing of the window to write
            self._stop(last_done=self._profile.step_num - 1)
        self._next = _NEVER

    # ----------------------------------------------------------------------------- internals

    def _begin(self, done: int) -> None:
        """Start the profiler if step ``done + 1`` is the warm-up step or inside the window."""
        if done < self._next:
            return
        if done >= self.last_step:  # already past the window (a resumed run)
            self._next = _NEVER
            return
        first = self.first_step
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        action = torch.profiler.ProfilerAction

        def schedule(step: int):
            # A schedule puts the ProfilerStep#N spans in the trace; N < first_step is the warm-up. The
            # profiler asks for step 0 when it is built, before step_num is set to the global step below.
            return schedule(done + 1) if step == 0 else action.WARMUP if step < first else action.RECORD

        profile = torch.profiler.profile(
            activities=activities, record_shapes=False, with_stack=self.with_stack, schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.out_dir, worker_name=f"rank{self.rank}"))
        profile.step_num = done + 1  # spans named by the global step
        try:
            profile.start()
        except RuntimeError as exc:  # another profiler holds the tracer: train on, without this one
            logger.warning("rank %d: profile_steps=(%d, %d) not profiled: torch.profiler did not start (%s)",
                           self.rank, self.first_step, self.last_step, exc)
            self._next = _NEVER
            return
        self._profile = profile
        self._next = done + 1

    def _advance(self, done: int) -> None:
        if done >= self.last_step:
            self._stop(last_done=done)
            self._next = _NEVER
        else:
            self._profile.step()
            self._next = done + 1

    def _stop(self, last_done: int) -> None:
        profile, self._profile = self._profile, None
        if self.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the last step's kernels finish inside the trace
        before = set(_traces(self.out_dir, self.rank))
        profile.stop()  # writes the trace (on_trace_ready) if a step in the window was recorded
        written = sorted(set(_traces(self.out_dir, self.rank)) - before)
        if written:
            self.trace_path = os.path.join(self.out_dir, written[-1])
            logger.info("rank %d: trace of steps %d-%d written to %s (tensorboard --logdir %s, or open it in "
                        "https://ui.perfetto.dev)", self.rank, self.first_step, last_done,
                        self.trace_path, self.out_dir)


def _traces(out_dir: str, rank: int) -> list:
    if not os.path.isdir(out_dir):
        return []
    return [name for name in os.listdir(out_dir) if name.startswith(f"rank{rank}.") and ".pt.trace.json" in name]
