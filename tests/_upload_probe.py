"""A user dataset factory for tests/test_async_upload.py: digits, with rank 0's checkpoint uploads slowed.

``dataset="_upload_probe:digits"`` with ``data_root=<probe dir>`` holding ``plan.json``
``{"upload_s": 1.0, "kill_in_upload": 3}``. Inside Ray Train's rank 0 it wraps the function
Ray Train V2 copies a checkpoint to storage with (``storage._pyarrow_fs_copy_files``, run in
Ray's upload thread for an asynchronous report): each upload sleeps ``upload_s`` first, then
copies, and appends ``{"dest", "start", "end"}`` to ``uploads.jsonl``. Upload number
``kill_in_upload`` (counted over the run, through ``uploads.jsonl``; once) instead writes half of
every file's bytes (JSON files whole), records the folder in ``killed_in_upload`` and SIGKILLs
the process: a failure in the middle of an upload. Every training batch rank 0 reads appends
its time to ``batches-<pid>.txt``.

The helpers only observe and inject faults; nothing here touches the code under test.
``fit`` ships this file to the workers, so it must not import other test helpers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, digits as _digits


def digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    rank = _world_rank()
    if rank != 0 or not cfg.data_root:  # the driver (check_data), or another rank
        return data
    probe = Path(cfg.data_root)
    _slow_uploads(probe, json.loads((probe / "plan.json").read_text()))
    return data._replace(train=_Timed(data.train, probe / f"batches-{os.getpid()}.txt"))


def _world_rank():
    try:
        import ray.train

        return ray.train.get_context().get_world_rank()
    except Exception:
        return None


class _Timed(Dataset):
    def __init__(self, inner, path: Path):
        self.inner, self.path = inner, path

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        with open(self.path, "a") as f:
            f.write(f"{time.time()}\n")
        return self.inner.__getitems__(indices)


def _slow_uploads(probe: Path, plan: dict) -> None:
    from ray.train.v2._internal.execution import storage

    upload = storage._pyarrow_fs_copy_files
    log = probe / "uploads.jsonl"

    def slow_upload(source, destination, source_filesystem=None, destination_filesystem=None, **kwargs):
        number = 1 + (len(log.read_text().splitlines()) if log.exists() else 0)
        start = time.time()
        if number == plan.get("kill_in_upload") and not (probe / "killed_in_upload").exists():
            (probe / "killed_in_upload").write_text(str(destination))
            for name in sorted(os.listdir(source)):
                data = Path(source, name).read_bytes()
                with destination_filesystem.open_output_stream(f"{destination}/{name}") as f:
                    f.write(data if name.endswith(".json") else data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(plan.get("upload_s", 0.0))
        result = upload(source, destination, source_filesystem=source_filesystem,
                        destination_filesystem=destination_filesystem, **kwargs)
        with open(log, "a") as f:
            f.write(json.dumps({"dest": str(destination), "start": start, "end": time.time()}) + "\n")
        return result

    storage._pyarrow_fs_copy_files = slow_upload
