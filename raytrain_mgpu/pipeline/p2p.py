"""The stage processes' communication: their process groups, the warm-up that creates
every communicator before the first step, bounded waits, and NCCL's semantics on gloo.

**Why a warm-up.** NCCL creates a group's communicator on the group's first call, and
that creation blocks until every member makes its own first call on the same group
(gloo connects every group inside ``new_group``, so a CPU run never shows it). The
executor posts receives ahead of need, so a stage's first call on one channel can come
while its peer waits on another: walking our schedules, that deadlocks every ``gpipe``
run, ``1f1b`` with 3+ stages and ``interleaved_1f1b`` with 4 stages and 4 micro-batches.
:func:`warm_up` makes one exchange on every group a rank belongs to, every
rank walking the groups in the one order they were created in. That cannot deadlock: in
any cycle of waiting ranks, the one waiting at the earliest group is waiting for members
that have finished every earlier group, so they reach it. On real NCCL,
``init_process_group(device_id=...)`` also creates the default communicator eagerly.

**NCCL semantics on gloo** (:func:`nccl_semantics`: on when emulating GPUs): (a) tags
are dropped, so the messages of a group match in the order they were issued, as on
NCCL; (b) a rank's first call on a group waits until every member has made one (in the
rendezvous store, where NCCL's own start-up exchanges its id), failing after
``collective_timeout_s`` with the ranks that never came. A start-up order that would
hang on GPUs then fails the CPU tests instead, naming the ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raytrain_mgpu.engine import devices
from raytrain_mgpu.engine.liveness import POSITION, WAITING

__all__ = ["Comm", "StageGroups", "build_groups", "warm_up", "nccl_semantics", "HEADER_LEN", "header",
           "parse_header"]

logger = logging.getLogger(__name__)

HEADER_LEN = 10  # [ndim, up to 8 sizes, dtype code]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_FIRST_USE_KEY = "raytrain_mgpu/first_use"
Channel = Tuple[str, int, int]  # (kind, src pipeline rank, dst pipeline rank)


def nccl_semantics(use_gpu: bool) -> bool:
    """Whether gloo must behave like NCCL: the run intends NCCL but computes on CPU."""
    return devices.intended_backend(use_gpu) == "nccl" and devices.is_emulated()


def header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > HEADER_LEN - 2:
        raise ValueError(f"a {tensor.dim()}-d tensor cannot pass between stages: at most {HEADER_LEN - 2} dimensions")
    sizes = list(tensor.shape) + [0] * (HEADER_LEN - 2 - tensor.dim())
    return torch.tensor([tensor.dim()] + sizes + [_DTYPES.index(tensor.dtype)], dtype=torch.int64,
                        device=tensor.device)


def parse_header(values: torch.Tensor) -> tuple:
    values = values.tolist()
    return tuple(values[1:1 + values[0]]), _DTYPES[values[-1]]


class Comm:
    """One rank's point-to-point calls and group first uses; every wait bounded by ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float, emulate_nccl: bool):
        self.rank, self.timeout_s, self.emulate_nccl = rank, timeout_s, emulate_nccl
        self.labels: Dict[str, str] = {}  # group name -> what it is, for error messages
        self._used: set = set()

    def label(self, group) -> str:
        return self.labels.get(getattr(group, "group_name", ""), "a process group")

    def first_use(self, group) -> None:
        """Under NCCL semantics, the first call on ``group`` waits for every member's first call."""
        if not self.emulate_nccl or group.group_name in self._used:
            return
        self._used.add(group.group_name)
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        prefix = f"{_FIRST_USE_KEY}/{group.group_name}"
        store.set(f"{prefix}/{self.rank}", "1")
        try:
            store.wait([f"{prefix}/{r}" for r in ranks], timedelta(seconds=self.timeout_s))
        except Exception:  # a timeout: say who never came
            missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            raise RuntimeError(
                f"rank {self.rank}: the first use of {self.label(group)} (global ranks {ranks}) waited "
                f"collective_timeout_s={self.timeout_s:g} s, and rank(s) {missing} never used it. On NCCL a "
                f"group's communicator is created on its first call, which blocks until every member makes "
                f"one: this start-up order hangs on GPUs (emulated NCCL semantics).") from None

    def isend(self, tensor: torch.Tensor, dst: int, group, tag: int = 0):
        self.first_use(group)
        return dist.isend(tensor, dst=dst, group=group, tag=0 if self.emulate_nccl else tag)

    def irecv(self, tensor: torch.Tensor, src: int, group, tag: int = 0):
        self.first_use(group)
        return dist.irecv(tensor, src=src, group=group, tag=0 if self.emulate_nccl else tag)

    def wait(self, work, what: str) -> None:
        """``work.wait`` bounded by ``collective_timeout_s``; the error says ``what`` was waited for.

        On real NCCL the bound is NCCL's watchdog (the process group's timeout is
        ``collective_timeout_s``; the warm-up created every communicator, so it covers every
        op): a timed ``WorkNCCL.wait`` would block the host until the transfer is done and
        delay the launch of the next kernels, where a plain wait only orders the streams.
        """
        POSITION.mark(f"{WAITING}: {what}")  # this rank waits for another (engine/liveness.py)
        if dist.get_backend() == "nccl":
            work.wait()
            return
        started = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise RuntimeError(f"{what}: failed after {time.monotonic() - started:.1f} s "
                               f"(collective_timeout_s={self.timeout_s:g}): {exc}") from exc

    def recv(self, tensor: torch.Tensor, src: int, group, what: str, tag: int = 0) -> torch.Tensor:
        self.wait(self.irecv(tensor, src, group, tag), what)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, group) -> None:
        """Blocking; gloo and NCCL bound it by the process group's timeout (``collective_timeout_s``)."""
        self.first_use(group)
        dist.all_reduce(tensor, group=group)

    def isend_with_header(self, tensor: torch.Tensor, dst: int, group) -> list:
        """Send a tensor of any shape (two messages); returns ``(work, tensor)`` pairs to wait on."""
        tensor = tensor.contiguous()
        head = header(tensor)
        return [(self.isend(head, dst, group), head), (self.isend(tensor, dst, group), tensor)]

    def recv_with_header(self, src: int, group, device: torch.device, what: str) -> torch.Tensor:
        head = self.recv(torch.empty(HEADER_LEN, dtype=torch.int64, device=device), src, group, what)
        shape, dtype = parse_header(head)
        return self.recv(torch.empty(shape, dtype=dtype, device=device), src, group, what)


@dataclass
class _Warmup:
    """One group this rank belongs to: p2p ``src -> dst`` (global ranks), then an all-reduce if ``collective``."""

    group: object
    src: Optional[int]
    dst: Optional[int]
    collective: bool


@dataclass
class StageGroups:
    """The groups of one pipeline rank; ``None`` where the run has no such group."""

    channels: Dict[Channel, object]  # this replica's one-way channels, by pipeline ranks
    targets: Optional[object] = None  # first stage -> last stage (the labels)
    stage: Optional[object] = None    # this pipeline rank in every replica (gradient averaging)
    replica: Optional[object] = None  # every pipeline rank of this replica (clipping norm)
    warmups: List[_Warmup] = field(default_factory=list)  # in creation order: the one global order


def build_groups(comm: Comm, channel_keys: Sequence[Channel], num_ranks: int, num_replicas: int,
                 rank: int, first: int, last: int) -> StageGroups:
    """Create every group on every rank in the same order (a torch.distributed rule)."""
    P, D = num_ranks, num_replicas
    replica, prank = divmod(rank, P)
    out = StageGroups(channels={})

    def new(members: List[int], label: str, mine: bool, src=None, dst=None, collective=False):
        group = dist.new_group(members)
        if mine:
            comm.labels[group.group_name] = label
            out.warmups.append(_Warmup(group, src, dst, collective))
        return group

    for r in range(D):
        for kind, src, dst in sorted(channel_keys):
            group = new([r * P + src, r * P + dst], f"channel {kind} {src}->{dst} of replica {r}",
                        r == replica and prank in (src, dst), r * P + src, r * P + dst)
            if r == replica:
                out.channels[(kind, src, dst)] = group
    if first != last:
        for r in range(D):
            group = new([r * P + first, r * P + last], f"the targets group of replica {r}",
                        r == replica and prank in (first, last), r * P + first, r * P + last, collective=True)
            out.targets = group if r == replica else out.targets
    if D > 1:
        for p in range(P):
            group = new([r * P + p for r in range(D)], f"the stage group of pipeline rank {p}", p == prank,
                        collective=True)
            out.stage = group if p == prank else out.stage
    if P > 1:
        for r in range(D):
            group = new([r * P + p for p in range(P)], f"the replica group of replica {r}", r == replica,
                        collective=True)
            out.replica = group if r == replica else out.replica
    return out


def warm_up(comm: Comm, groups: StageGroups, device: torch.device) -> None:
    """One exchange on every group of this rank, in creation order, so each communicator exists.

    Costs one tiny message per channel and one all-reduce per collective group, once per
    run: milliseconds, against a hang on the first step.
    """
    started = time.perf_counter()
    for item in groups.warmups:
        if item.src is not None:
            token = torch.zeros(1, device=device)
            what = f"rank {comm.rank}: warm-up of {comm.label(item.group)}"
            if comm.rank == item.src:
                comm.wait(comm.isend(token, item.dst, item.group), what)
            else:
                comm.recv(token, item.src, item.group, what)
        if item.collective:
            comm.all_reduce(torch.zeros(1, device=device), item.group)
    logger.debug("rank %d: %d groups warmed up in %.3f s", comm.rank, len(groups.warmups),
                 time.perf_counter() - started)
