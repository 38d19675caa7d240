"""User code for the pipeline step-checkpoint tests (``tests/test_pipeline_step_checkpoints.py``).

``dataset="_pipe_probe:digits"`` with ``data_root=<probe dir>``: digits whose training batches,
read inside a Ray actor (a pipeline stage), append their indices to ``<probe>/indices-<pid>.txt``
(one line per batch): what each stage process trained on.

``model="_pipe_probe:mlp_on_slow_storage"`` with ``model_kwargs={"widths": [...], "write_delay_s": s}``:
the library's MLP; inside a Ray actor, every checkpoint part the process writes
(``engine.checkpoint_files.write_checkpoint``) first sleeps ``write_delay_s``: a slow storage, for
measuring how long a save stalls the stages. The test process itself is never patched.

``model="_pipe_probe:mlp_whose_last_stage_dies"`` with ``model_kwargs={"widths": [...], "probe": dir,
"after_steps": N, "microbatches": M, "run_dir": path, "checkpoint_step": S}``: the library's MLP
(the same weights from the same seed) and a parameter-free last block, so in the last stage. Inside a
Ray actor, on its first training forward after N optimizer steps (M forwards a step) that block waits
until the run's checkpoint of global step S is complete (``<run_dir>/checkpoint_*/meta.json``, which
the driver writes last) and SIGKILLs its process, once per probe dir (``<probe>/died``): a last stage
lost mid-run, the steps since that checkpoint lost with it. Outside an actor (the in-process
references) it does nothing.

``fit`` ships this file to the stage actors (a user module outside site-packages).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, digits as _digits


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    if not cfg.data_root or not _in_ray_actor():
        return data
    return data._replace(train=_Recording(data.train, Path(cfg.data_root) / f"indices-{os.getpid()}.txt"))


class _Recording(Dataset):
    def __init__(self, inner, log: Path):
        self.inner, self.log = inner, log

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):  # the last stage reads one sample for the targets' structure: not recorded
        return self.inner[index]

    def __getitems__(self, indices):  # the DataLoader's batches
        with open(self.log, "a") as f:
            f.write(" ".join(str(int(i)) for i in indices) + "\n")
        return self.inner.__getitems__(indices)


def mlp_on_slow_storage(input_shape, num_classes, widths, write_delay_s: float = 0.0):
    from raytrain_mgpu.models import build_model

    if write_delay_s and _in_ray_actor():
        from raytrain_mgpu.checkpointing import files as checkpoint

        write = checkpoint.write_checkpoint
        if not getattr(write, "slowed", False):
            def slow_write(*args, **kwargs):
                time.sleep(write_delay_s)
                return write(*args, **kwargs)

            slow_write.slowed = True
            checkpoint.write_checkpoint = slow_write
    return build_model("mlp", input_shape, num_classes, {"widths": list(widths)})


CHECKPOINT_WAIT_S = 300.0  # then it dies anyway, and the test's assertions say what was lost


def mlp_whose_last_stage_dies(input_shape, num_classes, widths, probe: str, after_steps: int, microbatches: int,
                              run_dir: str, checkpoint_step: int):
    from raytrain_mgpu.models import build_model

    model = build_model("mlp", input_shape, num_classes, {"widths": list(widths)})
    model.append(_DieAfterCheckpoint(Path(probe), after_steps * microbatches + 1, Path(run_dir), checkpoint_step))
    return model


class _DieAfterCheckpoint(nn.Module):
    def __init__(self, probe: Path, at_forward: int, run_dir: Path, checkpoint_step: int):
        super().__init__()
        self.probe, self.at_forward, self.run_dir, self.checkpoint_step = probe, at_forward, run_dir, checkpoint_step
        self.forwards = 0

    def forward(self, x):
        if self.training and _in_ray_actor():
            self.forwards += 1
            if self.forwards == self.at_forward:
                self._die()
        return x

    def _complete(self) -> bool:
        for meta in self.run_dir.glob("checkpoint_*/meta.json"):
            try:
                if json.loads(meta.read_text())["step"] == self.checkpoint_step:
                    return True
            except (OSError, ValueError):  # being written
                pass
        return False

    def _die(self) -> None:
        try:  # once per probe dir: a restarted stage trains on
            os.close(os.open(self.probe / "died", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        while not self._complete() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
