"""The engine's step: what ends every optimizer step (:class:`OptimizerStep`), the interface a strategy's step
runner implements (:class:`Steps`), what a user's own step receives (:class:`StepContext`), and the guard against
non-finite losses (``TrainConfig.on_nonfinite``). Used by ``engine/loop.py`` on every rank of every transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.engine.step_scalars import StepWindow

__all__ = ["STEP_EVENTS", "OptimizerStep", "Steps", "StepContext", "NonFiniteError"]

STEP_EVENTS: List[Callable[[int], None]] = []
"""Called with the global step after every optimizer step, in every process that trains, by
:class:`OptimizerStep`: the engine's hook for what observes or disturbs training from outside (tests
register probes here; a run registers none)."""

_FIXES = ("a lower lr, grad_clip_norm (e.g. 1.0), precision='bf16-mixed' instead of '16-mixed', or "
          "on_nonfinite='skip' to skip such steps")


class NonFiniteError(RuntimeError):
    """The loss (or the weights) became NaN or infinite (``TrainConfig.on_nonfinite``): the run stops before any
    checkpoint of such weights is written, so its last checkpoint is the last finite one."""

    def __init__(self, what: str, epoch: int, step: int, ranks: Optional[list] = None):
        where = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
        super().__init__(f"{what} at step {step} (epoch {epoch}){where}: the run stops before any checkpoint of "
                         f"non-finite weights; its last checkpoint holds the last finite ones. Try {_FIXES}.")
        self.what, self.epoch, self.step, self.ranks = what, epoch, step, ranks

    def __reduce__(self):  # rebuilt from its fields (its message is made from them): Ray sends it to the driver
        return type(self), (self.what, self.epoch, self.step, self.ranks), self.__dict__


@dataclass
class StepContext:
    """What a user's ``train_step(model, batch, ctx)`` may read: where it runs and what the config gives it."""

    rank: int
    world_size: int
    device: torch.device
    precision: str
    loss: Callable  # the config's loss: loss(outputs, targets) -> the mean loss
    metrics: list   # the config's metric names
    epoch: int = 0  # 0-based epoch being trained
    step: int = 0   # global optimizer steps already taken


class OptimizerStep:
    """The end of every training step, once the step's gradients are in place: the rate the step used read,
    gradients unscaled (fp16's ``scaler``; the ranks of a pipeline agree on an overflow) and clipped to
    ``grad_clip_norm`` by ``clip`` (the runner's norm: over this model, or over every stage of a pipeline), the
    optimizer stepped, gradients dropped, the LR schedule moved, the step's scalars added to ``window``,
    :data:`STEP_EVENTS` called.

    ``on_nonfinite="skip"``: a step whose gradient norm is not finite (the same on every rank: after DDP's
    all-reduce, FSDP's and the pipeline's global norm) drops its gradients instead of stepping (one host read a
    step, as fp16's scaler makes); ``max_skipped_steps`` in a row raise :class:`NonFiniteError`. Where a norm is
    computed (clipping, skip) its sum over the epoch gives the row's ``grad_norm`` (its mean), read once an epoch."""

    def __init__(self, cfg, optimizer, scheduler, clip: Callable[[float], object], scaler=None, window=None,
                 grad_norm: Optional[Callable[[], torch.Tensor]] = None, agree: Optional[Callable] = None):
        self.cfg, self.optimizer, self.scheduler, self.clip = cfg, optimizer, scheduler, clip
        # fp16's scaler only: a disabled one's step()/update() are calls that do nothing but cost a few us a step
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.window, self.grad_norm, self.agree = window, grad_norm, agree
        self.skip = getattr(cfg, "on_nonfinite", "stop") == "skip"
        self.skipped = self.in_a_row = 0  # skipped steps this epoch, and the current run of them
        self.norm_sum: Optional[torch.Tensor] = None  # the epoch's gradient norms, summed on the device
        self.norms = 0
        self.epoch = 0  # the 1-based epoch being trained (set by the engine), for the error's words

    def __call__(self, step: int) -> Optional[dict]:
        """Take global step ``step`` (counted from 1 by the caller); the ``train/*`` scalars of the
        ``log_every_n_steps`` window it closes (one device read), else None."""
        optimizer = self.optimizer
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
        norm = None
        if self.scaler is not None and (self.cfg.grad_clip_norm is not None or self.agree is not None):
            self.scaler.unscale_(optimizer)
            if self.agree is not None:
                self.agree(self.scaler, optimizer)  # every stage skips an overflow any stage saw
        if self.cfg.grad_clip_norm is not None:
            norm = self.clip(self.cfg.grad_clip_norm)
        elif self.skip:
            norm = self.grad_norm()
        if self.skip and not bool(torch.isfinite(norm)):  # the host read skipping costs
            self._skip(step)
        else:
            self.in_a_row = 0
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
            if norm is not None:
                self.norm_sum = norm.detach().double() if self.norm_sum is None else self.norm_sum + norm.detach()
                self.norms += 1
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        for event in STEP_EVENTS:
            event(step)
        if self.window is None:
            return None
        self.window.end_step(lr, norm)
        return self.window.read() if step % self.cfg.log_every_n_steps == 0 else None

    def _skip(self, step: int) -> None:
        self.skipped += 1
        self.in_a_row += 1
        if self.scaler is not None:
            self.scaler.update()  # the scale halves, as after an overflow
        if self.in_a_row >= self.cfg.max_skipped_steps:
            raise NonFiniteError(f"{self.in_a_row} optimizer steps in a row had non-finite gradients "
                                 f"(max_skipped_steps={self.cfg.max_skipped_steps})", self.epoch, step)

    def epoch_norm(self) -> tuple:
        """``(sum of this epoch's gradient norms on the device, or None; how many)``, and a new epoch."""
        total, count, self.norm_sum, self.norms = self.norm_sum, self.norms, None, 0
        return total, count


class Steps:
    """What a strategy gives the engine on one rank (the defaults are a data-parallel worker's).

    Set by the runner's constructor, from the run's config: ``ctx`` (a ``WorkerContext``), ``device`` (where the
    step's sums live), ``objective``, ``precision`` (``engine/precision.Precision``: the forwards' autocast, the
    engine's grad scaler), ``step_context`` (what a user's own step receives; the engine moves its epoch and
    step); ``reads_data``/``sees_loss``: this rank loads batches / computes the loss; ``shard``:
    ``(replica index, replicas)`` of this rank's data; ``loader_batch``: samples per loader batch; ``part``: the
    suffix of this rank's checkpoint files (``""``, ``"-stage1"``). The engine sets nothing on its runner.
    """

    reads_data = sees_loss = True
    agrees_on_overflow = False  # fp16: the ranks sharing a step agree on an overflow (a pipeline's stages)
    read_ahead = False  # load the next batch in a thread while this rank computes (a pipeline's first stage)
    may_hold_no_parameters = False  # a rank whose part has no parameters still trains (a pipeline's stage)
    part = ""
    sharded = False  # every rank writes its own shards of one checkpoint (fsdp)
    save_trainable = False  # save="trainable": a checkpoint's model part holds the trainable parameters and buffers
    step_context: StepContext  # what a user's own step receives (made by the runner, moved on by the engine)

    def build_on_meta(self) -> bool:
        """Whether this rank builds the model on ``meta`` (fsdp's ranks but 0: rank 0's weights reach them)."""
        return False

    def accum_at(self, plan, num_shards: int) -> int:
        """Micro-steps per optimizer step at ``num_shards`` data shards."""
        return 1

    def loader_batch(self, plan) -> int:
        """Samples per batch of this rank's loader."""
        raise NotImplementedError

    def setup(self, model: torch.nn.Module, model_state: Optional[dict]) -> None:
        """Place, wrap or split ``model`` (built on the run's seed), loading ``model_state`` (a resume's)."""
        raise NotImplementedError

    def parameters(self) -> list:
        raise NotImplementedError

    def named_model(self) -> torch.nn.Module:
        """The user's model inside any wrapper (``param_groups`` names its parameters)."""
        raise NotImplementedError

    def load_optimizer(self, optimizer, train_state: dict) -> None:
        optimizer.load_state_dict(train_state["optimizer"])

    def train(self, mode: bool = True) -> None:
        raise NotImplementedError

    def train_step(self, next_batch: Callable[[], tuple], meter: EpochMeter, window: Optional[StepWindow],
                   scaler, accum: int) -> None:
        """Forward and backward one optimizer step's micro-batches (``accum`` of them for a data-parallel
        worker), gradients in place and synced across replicas; every micro-batch's loss into ``meter``."""
        raise NotImplementedError

    def step_time(self, seconds: float) -> None:
        """One step's wall time on this rank (a pipeline stage sums them for its row)."""

    def clip(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    def grad_norm(self) -> torch.Tensor:
        """The total norm of this model's gradients (over every stage, every shard), nothing clipped."""
        return self.clip(math.inf)

    def agree_found_inf(self, scaler, optimizer) -> None:
        """fp16: after ``scaler.unscale_``, make this rank's overflow verdict every rank's that shares the step."""

    def weights_finite(self) -> bool:
        """Whether every parameter and floating buffer this rank holds is finite (one host read)."""
        tensors = [t for t in self.owned_tensors() if t.is_floating_point()]
        if not tensors:
            return True
        return bool(torch.stack([torch.isfinite(_local(t)).all() for t in tensors]).all())

    def owned_tensors(self) -> list:
        """The parameters and buffers this rank holds (its shards, its stages)."""
        raise NotImplementedError

    def evaluate(self, loader, meter: EpochMeter) -> None:
        raise NotImplementedError

    def memory_devices(self) -> List[torch.device]:
        return [self.device]

    def epoch_stats(self) -> dict:
        """This rank's small per-epoch record (gathered to every rank with the memory peaks)."""
        return {}

    def epoch_columns(self, stats: list) -> dict:
        """Extra history columns from every rank's :meth:`epoch_stats`."""
        return {}

    def epoch_scalars(self, stats: list, row: dict) -> dict:
        """Per-epoch scalars for the loggers (rank 0), from every rank's :meth:`epoch_stats` and the row."""
        return {}

    def checkpoint_files(self, optimizer) -> dict:
        """``{file name: object}`` this rank writes into a checkpoint (``torch.save``d)."""
        raise NotImplementedError

    def write_sharded(self, optimizer, path: str, asynchronous: bool):
        raise NotImplementedError

    def load_sharded(self, optimizer, path: str) -> None:
        raise NotImplementedError

    def meta_extra(self) -> dict:
        """Keys this runner adds to ``meta.json`` (the pipeline's partition)."""
        return {}

    def model_state(self) -> dict:
        """The plain model's whole state (collective where sharded)."""
        raise NotImplementedError




def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard, or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
