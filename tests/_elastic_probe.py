"""A user dataset factory for the elastic two-node test: slow digits that record what each worker trained.

``dataset="_elastic_probe:slow_digits"`` with ``data_root=<probe dir>``: digits whose training
batches take at least ``SLOW_BATCH_S`` to read (a tiny model's run lasts long enough for the
cluster to grow and shrink under it). Inside a Ray Train worker it writes
``worker-<pid>.json`` (world rank and size, node IP, start time) and appends one line per
micro-batch it reads to ``batches-<pid>.txt``: with no loader workers a micro-batch is read
when the loop trains it, so the count tells how many micro-steps that process started.

``fit`` ships this file to the workers (a user module outside site-packages), so it imports
no other test helper. It only observes: nothing here changes what is trained.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, digits as _digits

SLOW_BATCH_S = 0.15


def slow_digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    log = None
    try:
        import ray.train

        ctx = ray.train.get_context()
        info = {"world_rank": ctx.get_world_rank(), "world_size": ctx.get_world_size(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "started": time.time()}
    except Exception:  # on the driver (check_data): not a Ray Train worker
        info = None
    if info is not None and cfg.data_root:
        probe = Path(cfg.data_root)
        (probe / f"worker-{info['pid']}.json").write_text(json.dumps(info))
        log = probe / f"batches-{info['pid']}.txt"
    return data._replace(train=_SlowRecording(data.train, log))


class _SlowRecording(Dataset):
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        time.sleep(SLOW_BATCH_S)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{len(indices)}\n")
        return self.inner.__getitems__(indices)
