"""Every shipped job config loads and passes its strategy's checks (pure: no Ray, no data read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.strategies import get_strategy

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "jobs" / "configs").glob("*.yaml"))


def test_configs_folder_is_not_empty():
    assert len(CONFIGS) >= 5, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_job_config_loads_and_validates(path):
    cfg = TrainConfig.from_yaml(path)  # __post_init__ runs the strategy's validate
    get_strategy(cfg.strategy).validate(cfg)  # and again explicitly, in case that ever changes
    assert cfg.batch_size % get_strategy(cfg.strategy).data_parallel_size(cfg) == 0


@pytest.mark.parametrize("gpus, batch_size, lr", [(1, 256, 0.1), (2, 512, 0.2)])
def test_d2l_configs_use_plain_sgd(gpus, batch_size, lr):
    """d2l's multi-GPU ResNet-18 chapter trains with torch.optim.SGD(lr) (no momentum): 0.1 at 256, 0.2 at 512."""
    cfg = TrainConfig.from_yaml(CONFIGS[0].parent / f"resnet18_fashion_mnist_{gpus}gpu.yaml")
    assert (cfg.optimizer, cfg.momentum, cfg.weight_decay) == ("sgd", 0.0, 0.0)
    assert (cfg.num_workers, cfg.batch_size, cfg.lr, cfg.lr_scaling) == (gpus, batch_size, lr, None)
