"""User code for the pipeline step-checkpoint tests (``tests/test_pipeline_step_checkpoints.py``).

``dataset="_pipe_probe:digits"`` with ``data_root=<probe dir>``: digits whose training batches,
read inside a Ray actor (a pipeline stage), append their indices to ``<probe>/indices-<pid>.txt``
(one line per batch): what each stage process trained on.

``model="_pipe_probe:mlp_on_slow_storage"`` with ``model_kwargs={"widths": [...], "write_delay_s": s}``:
the library's MLP; inside a Ray actor, every checkpoint part the process writes
(``runtime.checkpoint.write_checkpoint``) first sleeps ``write_delay_s``: a slow storage, for
measuring how long a save stalls the stages. The test process itself is never patched.

``fit`` ships this file to the stage actors (a user module outside site-packages).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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
        from raytrain_mgpu.runtime import checkpoint

        write = checkpoint.write_checkpoint
        if not getattr(write, "slowed", False):
            def slow_write(*args, **kwargs):
                time.sleep(write_delay_s)
                return write(*args, **kwargs)

            slow_write.slowed = True
            checkpoint.write_checkpoint = slow_write
    return build_model("mlp", input_shape, num_classes, {"widths": list(widths)})
