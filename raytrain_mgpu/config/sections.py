"""The config's fixed choices (``Literal`` types) and the sections components receive.

``TrainConfig`` (``config/train.py``) is what users write; each component gets only its own section
(``cfg.data``, ``cfg.optim``, ``cfg.parallel``), filled by keyword from the fields of the
same names. No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Tuple, Union

# The fixed choices: ``config_checks`` checks each ``Literal`` field against its type's values.
Precision = Literal["32", "16-mixed", "bf16-mixed"]
Optimizer = Literal["sgd", "adamw"]  # or a "module:function": fields typed Union[Literal, str] take both
LrSchedule = Literal["constant", "step", "cosine", "linear", "wsd"]  # or a "module:function": the user's scheduler
LrScaling = Literal[None, "linear", "sqrt"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Placement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
Balance = Union[Literal["params", "time"], Tuple[int, ...]]  # a tuple: block counts per stage
Loss = Literal["cross_entropy", "mse", "l1", "bce_with_logits", "smooth_l1"]  # or a "module:function"
Metric = Literal["accuracy", "top5", "mae", "mse"]  # TrainConfig.metrics lists these or "module:function"s
Logger = Literal["tensorboard", "mlflow", "csv", "wandb"]  # TrainConfig.loggers is a list of these
MonitorMode = Literal["auto", "min", "max"]  # auto: follows the metric (config_code.better_mode)
Ingest = Literal["loader", "ray_data"]  # how the training split reaches the workers
Runner = Literal["auto", "local", "ray"]  # where a run trains: the driver's process, or Ray
OnNonfinite = Literal["stop", "skip", "ignore"]  # what a non-finite loss does to a run
SaveWhat = Literal["full", "trainable"]  # what a checkpoint's model part holds
Resume = Literal["auto", "never", "must"]  # what a run started again under its name does (driver/preflight.py)
FaultTolerance = Literal["restart", "replica_groups"]  # what a lost worker costs (engine/replica_groups.py)
Compile = Union[bool, Literal["blocks"]]  # torch.compile: off, the whole model, or each block in place
# A tensor-parallel plan's styles (TrainConfig.tensor_parallel_plan's values; parallel/tensor_parallel.py): torch's
# ColwiseParallel, RowwiseParallel, SequenceParallel, and Hugging Face's names for Colwise with a gathered output
# and Rowwise on an embedding.
TensorParallelStyle = Literal["colwise", "rowwise", "sequence_parallel", "colwise_gather_output",
                              "embedding_rowwise"]


# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DataConfig:
    """What the data readers need."""

    dataset: str
    data_root: Optional[str]
    download: bool
    num_samples: Optional[int]
    input_shape: Optional[tuple]
    num_classes: Optional[int]
    image_column: str
    label_column: str
    seed: int
    # data loading (engine/loaders.py) and per-sample transforms (data/transforms.py); defaults for readers
    # used on their own (``data convert``, tests): the TrainConfig fields' defaults
    loader_workers: int = 0
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = True
    train_transform: Optional[str] = None
    test_transform: Optional[str] = None
    val_fraction: Optional[float] = None  # a held-out part of the training split (data/base.split_validation)
    ingest: Ingest = "loader"  # "ray_data": the training split streamed by Ray Data (transports/ray_data.py)
    collate: Optional[object] = None  # Ray Datasets' batch -> (inputs, targets) (data/ray_datasets.py)
    # the text dataset (data/lm_text.py): its column, tokenizer folder and block length; the model's name, whose
    # hf:<folder> holds the default tokenizer and the config.json that sizes the data (vocabulary, positions)
    text_column: str = "text"
    tokenizer: Optional[str] = None
    seq_len: Optional[int] = None
    model: object = None


@dataclass(frozen=True)
class OptimConfig:
    """What the optimizer, LR schedule and gradient handling need."""

    optimizer: Union[Optimizer, str]
    lr: float
    momentum: float
    weight_decay: float
    lr_schedule: Union[LrSchedule, str, Callable]  # a name, or the user's fn(optimizer, total_steps) -> LRScheduler
    warmup_epochs: float
    warmup_steps: Optional[int]
    min_lr: float
    decay_fraction: float
    max_steps: Optional[int]  # with epochs (given to optim.build_scheduler), the run's total optimizer steps
    lr_step_epochs: int
    lr_step_gamma: float
    lr_scaling: LrScaling
    base_batch_size: int
    batch_size: int
    grad_clip_norm: Optional[float]
    optimizer_kwargs: dict

    def scaled_lr(self) -> float:
        """Peak LR after scaling with the global batch (Goyal et al. 2017)."""
        ratio = self.batch_size / self.base_batch_size
        if self.lr_scaling == "linear":
            return self.lr * ratio
        if self.lr_scaling == "sqrt":
            return self.lr * ratio**0.5
        return self.lr


@dataclass(frozen=True)
class ParallelConfig:
    """How the work is spread over processes and devices."""

    strategy: str
    num_workers: int
    use_gpu: bool
    gpus_per_worker: int
    cpus_per_worker: int
    batch_size: int
    grad_accum_steps: int
    precision: Precision
    # model / pipeline parallel
    num_stages: int
    num_microbatches: int
    schedule: Schedule
    balance: Balance
    placement: Placement
    output_device: Optional[int]
    # DDP pass-through options
    find_unused_parameters: bool
    static_graph: bool
    bucket_cap_mb: Optional[float]
    gradient_as_bucket_view: bool
    sync_batchnorm: bool
    compile: Compile
    channels_last: bool
    shard_group_size: Optional[int]
    cpu_offload: bool
    tensor_parallel_size: int
    tensor_parallel_plan: Optional[dict]
    tensor_parallel_across_nodes: bool
    activation_checkpointing: int
    collective_timeout_s: float
