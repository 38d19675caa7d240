"""Where ``fault_tolerance="replica_groups"`` can run (``engine/replica_groups.py``), checked before Ray with the
strategy's other rules (``config/checks.py``)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_mgpu.config.train import TrainConfig

__all__ = ["check_replica_groups"]


def check_replica_groups(cfg: "TrainConfig", strategy_cls) -> None:
    """``fault_tolerance="replica_groups"`` where it can run: a strategy whose workers each hold one whole copy of the
    model on one device (Ray Train's ``TorchftConfig`` makes every worker a replica group of its own), on Ray
    Train's workers, with torchft installed and Ray Train allowed to replace a worker (``max_failures``)."""
    if getattr(cfg, "fault_tolerance", "restart") != "replica_groups":
        return
    name, why = strategy_cls.name, None
    if strategy_cls.runner != "train_workers":
        why = "its stages run in an actor group of its own, whose lost stage restarts the pipeline"
    elif strategy_cls.replication == "fully_shard":
        why = ("it shards the model over the workers, and Ray Train makes each worker a replica group of its own "
               "(one process a group): there is nothing to shard inside a group")
    elif strategy_cls.replication != "replicate":
        why = "it trains in one worker process: no other group carries on when it is lost"
    elif strategy_cls.placement != "device" or strategy_cls.tensor_group_size(cfg) > 1:
        why = "a worker's copy spans several devices or a tensor group, and a replica group here is one device"
    if why is not None:
        raise ValueError(f"TrainConfig.fault_tolerance='replica_groups' with strategy={name!r}: {why}. Use "
                         f"strategy='ddp' (one whole copy a worker), or fault_tolerance='restart'.")
    workers = cfg.num_workers
    if isinstance(workers, (list, tuple)) or (isinstance(workers, int) and workers < 2):
        raise ValueError(f"TrainConfig.num_workers={workers!r} with fault_tolerance='replica_groups': the groups are "
                         f"a fixed count of at least 2 (one group alone has no peer to carry on; Ray Train does not "
                         f"resize replica groups). Set num_workers to 2 or more.")
    if cfg.runner == "local" or cfg.ingest == "ray_data":
        field, value = ("runner", cfg.runner) if cfg.runner == "local" else ("ingest", cfg.ingest)
        raise ValueError(f"TrainConfig.{field}={value!r} with fault_tolerance='replica_groups': the groups are Ray "
                         f"Train workers reading their own shard with the loader. Set {field}="
                         f"{'auto' if field == 'runner' else 'loader'!r}.")
    if cfg.max_failures == 0:
        raise ValueError("TrainConfig.max_failures=0 with fault_tolerance='replica_groups': Ray Train replaces a lost "
                         "worker as one of its retries, so none would be. Set max_failures to the losses the run "
                         "may survive, e.g. 3 (-1: any number).")
    if importlib.util.find_spec("torchft") is None:
        raise ValueError("TrainConfig.fault_tolerance='replica_groups' needs torchft, which is not installed: "
                         "pip install 'raytrain-mgpu[ft]' (torchft-nightly, the release tested with this torch).")
