"""The benchmark's ``torchrun`` baseline: the same DDP loop without Ray.

    torchrun --nproc-per-node 2 -m raytrain_mgpu.bench._torchrun_ddp '<TrainConfig as JSON>'

Rank 0 prints one JSON line: {"samples_per_s": [global samples/s per epoch]}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mgpu.bench.ddp import plain_epoch
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.models import build_model


def main() -> None:
    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = DistributedDataParallel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=cfg.batch_size // world, sampler=sampler, drop_last=True)
    rates = []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        rates.append(plain_epoch(model, optimizer, loader, world))
    if rank == 0:
        print(json.dumps({"samples_per_s": rates}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
