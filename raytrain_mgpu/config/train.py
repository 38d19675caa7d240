"""Run configuration: one flat ``TrainConfig`` for users, small sections for components.

Users write ``TrainConfig(model=..., strategy=..., batch_size=...)`` (or a YAML file with
the same keys). Each component receives only its own section (``cfg.data``, ``cfg.optim``,
``cfg.parallel``), so a data reader cannot come to depend on, say, the LR schedule. A
section is filled by keyword from the ``TrainConfig`` fields of the same names.

Fields with a fixed set of values are typed ``Literal[...]``; the check of those values
reads the choices from the type, so the type and the error message list the same ones.

``config_checks.validate`` checks everything once, in ``__post_init__``: a bad value fails
here, on the driver, before Ray is started or any cluster resource is requested. Errors
name the field, the value, the rule and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional, Tuple, Union

import yaml

from raytrain_mgpu.config.names import names_unknown_fields, unknown_fields
from raytrain_mgpu.config.checks import validate, warn_unused
from raytrain_mgpu.config.sections import (Balance, Compile, DataConfig, Ingest, Logger, Loss, LrScaling,
                                           LrSchedule, MonitorMode, OptimConfig, Optimizer, ParallelConfig, Placement,
                                           OnNonfinite, Precision, Resume, Runner, SaveWhat, Schedule, FaultTolerance)
from raytrain_mgpu.data.transforms import factory_parts  # string parsing only: no torch
from raytrain_mgpu.config.factories import CODE_FIELDS, check_file_factories, code_record
from raytrain_mgpu.config import yaml_values as _yaml

# ----------------------------------------------------------------------------- user config


@names_unknown_fields  # TrainConfig(batchsize=64): "did you mean 'batch_size'?"
@dataclass
class TrainConfig:
    """Everything one training run needs. Every field can be set from YAML or the CLI."""

    # --- model and data
    model: str = "lenet"
    """Registry name (``lenet``, ``resnet18``, ``mlp``, ``transformer_lm``), ``pkg.module:function``, or from Python the class or function itself (``__main__`` and notebooks included); or ``hf:<folder>``, a Hugging Face folder (config.json, safetensors, tokenizer), also ``hf:s3://...`` or ``hf:org/name`` from the hub (docs/language-models.md)."""
    model_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for the model factory, e.g. ``{"widths": [256, 256]}`` for ``mlp``."""
    dataset: str = "digits"
    """Registry name (``digits``, ``fashion_mnist``, ``cifar10``, ``synthetic``, ``parquet``, ...), ``pkg.module:function`` taking the ``DataConfig`` and returning ``raytrain_mgpu.data.Datasets``, or from Python that function itself, or Ray Datasets: ``{"train": ds, "test": ds}`` (and ``"val"``), with ``collate`` (docs/data.md: Your own Ray Datasets)."""
    collate: Optional[str] = None
    """Ray Datasets only: ``function(batch)`` turning a batch, a dict of NumPy arrays (one per column), into ``(inputs, targets)`` tensors (``inputs`` a tensor or a dict of them); the function from Python, or ``pkg.module:function``."""
    data_root: Optional[str] = None
    """Folder (or, for ``parquet`` and ``text``, a file, folder or ``s3://``/``gs://`` URI) holding the dataset files."""
    download: bool = False
    """Download ``fashion_mnist``/``cifar10`` into ``data_root`` with torchvision when files are missing."""
    num_samples: Optional[int] = None
    """``synthetic*`` datasets: number of training samples (the test split is a quarter of it)."""
    input_shape: Optional[tuple] = None
    """``synthetic*`` datasets: shape of one sample, e.g. ``[3, 32, 32]`` or ``[128]`` (sequence length)."""
    num_classes: Optional[int] = None
    """``synthetic*`` datasets: number of classes (vocabulary size for text)."""
    image_column: str = "image"
    """``parquet``: the column with the images."""
    label_column: str = "label"
    """``parquet``: the column with the integer labels."""
    text_column: str = "text"
    """``text``: the column of the documents (strings, tokenized with ``tokenizer``) or of token-id lists, used as they are (a file without it that has ``input_ids``, as ``data tokenize`` writes, is read from that)."""
    tokenizer: Optional[str] = None
    """``text``: a tokenizer folder (``transformers.AutoTokenizer.from_pretrained``) that tokenizes ``text_column``; None: the folder of an ``hf:<folder>`` model. Token ids need none."""
    seq_len: Optional[int] = None
    """``text``: tokens per training sequence; the documents, each followed by the tokenizer's EOS, are packed into blocks of ``seq_len + 1`` tokens (the inputs and their next tokens). None: an ``hf:`` model's ``max_position_embeddings`` (at most 2048), else 128."""

    # --- data loading
    loader_workers: int = 0
    """``DataLoader`` worker processes per training worker (per first pipeline stage) that read, decode and transform samples; 0: in the training process. The samples, their order and the weights are the same for every count."""
    prefetch_factor: Optional[int] = None
    """Batches each loader worker reads ahead (``loader_workers`` > 0); None: torch's default (2)."""
    persistent_workers: bool = True
    """Keep the loader workers between epochs (``loader_workers`` > 0); datasets that load each epoch's rows in the training process (``parquet``) restart them every epoch regardless."""
    train_transform: Optional[str] = None
    """Per-sample augmentation of the training inputs: ``random_crop_flip`` (RandomCrop with padding 4 and RandomHorizontalFlip, the CIFAR recipe), ``resize:<n>`` (to n x n, e.g. ``resize:96`` as d2l does for Fashion-MNIST), several joined with ``+``, or ``pkg.module:function`` returning a callable on one input tensor; from Python, that callable itself. Seeded by (seed, epoch, sample): reproducible, and a resumed run equals an uninterrupted one."""
    test_transform: Optional[str] = None
    """The same for the test split (e.g. ``resize:96`` when training with it; a transform that changes the shape must be given for both)."""
    data_on_device: Optional[bool] = None
    """Keep the training split on the training device and take each batch from it by index (no DataLoader, no copy per step), for a dataset of tensors (a ``TensorDataset``) without a per-sample transform. None: on a GPU when the split takes under a quarter of its free memory; True: wherever it can; False: never. The same samples in the same order either way."""
    ingest: Ingest = "loader"
    """How the training split reaches the workers (the pipeline's first stages): ``loader`` (a ``DataLoader`` over the map-style dataset, in ``DistributedSampler`` order) or ``ray_data`` (``parquet`` only: Ray Data reads, decodes, normalises and transforms on CPU tasks and streams each worker its share in a planned order, the loader path's steps at any worker count, resumable at a step; docs/data.md: Streaming with Ray Data)."""

    # --- parallelism
    strategy: str = "ddp"
    """How the work is split: ddp, dp, dp_balanced, mp, ddp_mp, ddp2, fsdp, pipeline, ddp_pipeline (docs/strategies.md), or auto: chosen with its worker and stage counts from a memory estimate and the cluster's devices when fit starts."""
    num_workers: Union[int, Tuple[int, int], Literal["auto"]] = "auto"
    """``auto``: the strategy's own layout on the devices found when the run starts (``ddp`` one worker per GPU, ``dp`` and ``mp`` one worker holding a node's GPUs, the pipelines a stage per GPU; with no GPU 2 CPU workers, or 1 for ``dp``/``mp``), taking only the layout options left at their default. Or training processes (Ray Train workers), or pipeline replicas for ``ddp_pipeline``; or ``(min, max)`` (YAML ``[1, 4]``, CLI ``--num-workers 1-4``) for an elastic run of ``ddp``, ``ddp_mp`` or ``fsdp``: it starts with what the cluster has room for, from min up, and grows or shrinks (a restart from the latest checkpoint) as nodes come and go; the micro-batch is fixed by max, the accumulation steps follow the count, so the global batch and LR schedule stay exact (docs/clusters.md: Spot and elastic)."""
    use_gpu: Union[bool, Literal["auto"]] = "auto"
    """Give each worker GPUs (``gpus_per_worker``); otherwise train on CPU with gloo. ``auto``: True when there is a GPU to use when the run starts: on the Ray cluster this process is connected to (or ``address``/``RAY_ADDRESS`` names; an autoscaler's node types count), else on this machine; fit's banner says what it found."""
    gpus_per_worker: int = 1
    """Devices one worker holds (``dp``, ``dp_balanced``, ``mp``, ``ddp_mp``, ``ddp2``)."""
    cpus_per_worker: int = 1
    """CPU slots (and torch threads) per worker."""
    num_stages: int = 2
    """``pipeline``/``ddp_pipeline``: number of pipeline stages (one actor and device each)."""
    num_microbatches: int = 4
    """``pipeline``/``ddp_pipeline``: micro-batches per step and replica."""
    schedule: Schedule = "1f1b"
    """``pipeline``: micro-batch schedule, one of gpipe, 1f1b, interleaved_1f1b."""
    balance: Balance = "params"
    """How blocks are split over stages/devices: ``params``, ``time`` or a list of block counts."""
    placement: Placement = "PACK"
    """Placement group strategy for workers or stages (``PACK``, ``SPREAD``, ``STRICT_*``)."""
    resources_per_worker: dict = field(default_factory=dict)
    """Custom Ray resources each worker (pipeline stage) also needs, beside its CPUs and GPUs, e.g. ``{"spot": 1}`` for nodes whose type in ``cluster.yaml`` declares ``spot``; a request no node (alive, or a node type the autoscaler can add) has is refused before training."""
    accelerator_type: Optional[str] = None
    """``use_gpu``: the GPU type the workers run on, as Ray names it on its nodes (``A100``, ``H100``, ``L4``, ...; a node's ``accelerator_type:<name>`` resource); None: any GPU."""
    label_selector: dict = field(default_factory=dict)
    """Ray node labels the workers' nodes must carry, e.g. ``{"market-type": "spot"}`` (Ray's ``label_selector``; values as Ray writes them: ``"a"``, ``"!a"``, ``"in(a,b)"``)."""
    output_device: Optional[int] = None
    """``dp``/``ddp2``: local index of the device that gathers outputs (default: the first)."""
    auto_measure: bool = False
    """``strategy="auto"``: also time the strategies whose estimate fits in a short compare run (about one short run each) and take the fastest."""
    memory_budget_bytes: Optional[int] = None
    """Memory one device may use, e.g. ``24GiB`` or ``24e9``: ``strategy="auto"`` and ``compare`` check their estimates against it (default: the GPU's memory; none on CPU)."""
    elastic_resize_interval_s: float = 60.0
    """Elastic ``num_workers=(min, max)``: how often Ray Train checks, while training, whether the cluster now has room for another worker count (Ray's ``ScalingConfig.elastic_resize_monitor_interval_s``); a resize restarts the group from the latest checkpoint."""

    # --- batch and optimisation
    epochs: int = 8
    """Passes over the training split."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in total (benchmarks, quick checks)."""
    batch_size: int = 128
    """GLOBAL batch: samples per optimizer step, all workers together."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step on each worker; gradients sync only on the last."""
    optimizer: Union[Optimizer, str] = "adamw"
    """``adamw``, ``sgd`` (with ``momentum``) or ``pkg.module:function``, called as ``function(params, lr, **optimizer_kwargs)``, returning a ``torch.optim.Optimizer``."""
    lr: float = 0.02
    """Peak learning rate (before ``lr_scaling``)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 (SGD) or decoupled (AdamW) weight decay."""
    lr_schedule: Union[LrSchedule, str] = "constant"
    """Per optimizer step, after the warm-up: ``constant``, ``step``, ``cosine`` (to ``min_lr``), ``linear`` (to ``min_lr`` at the last step), ``wsd`` (warm-up, stable at the peak, then linear to ``min_lr`` over the last ``decay_fraction`` of the steps); or your own scheduler, ``fn(optimizer, total_steps)`` returning a ``torch.optim.lr_scheduler.LRScheduler`` (from Python the function, else ``pkg.module:function``), stepped once per optimizer step and checkpointed. Total steps: ``epochs`` x steps per epoch, or ``max_steps`` if smaller."""
    warmup_epochs: float = 0.0
    """Linear warm-up from 0 to the peak LR, in epochs (fractions allowed)."""
    warmup_steps: Optional[int] = None
    """Linear warm-up from 0 to the peak LR over this many optimizer steps (instead of ``warmup_epochs``)."""
    min_lr: float = 0.0
    """The LR ``cosine``, ``linear`` and ``wsd`` decay to (absolute, below ``lr``; a parameter group with its own ``lr`` decays by the same factor)."""
    decay_fraction: float = 0.1
    """``wsd``: the last fraction of the steps, in (0, 1], over which the LR decays to ``min_lr``."""
    lr_step_epochs: int = 30
    """``step`` schedule: multiply the LR by ``lr_step_gamma`` every this many epochs."""
    lr_step_gamma: float = 0.1
    """``step`` schedule: the factor."""
    lr_scaling: LrScaling = None
    """Scale ``lr`` with ``batch_size / base_batch_size``: ``linear``, ``sqrt`` or None."""
    base_batch_size: int = 256
    """The batch size at which ``lr`` was tuned (for ``lr_scaling``)."""
    grad_clip_norm: Optional[float] = None
    """Clip the global gradient norm to this value."""
    precision: Precision = "32"
    """``32``, ``16-mixed`` (fp16 autocast + GradScaler, CUDA only) or ``bf16-mixed``."""
    optimizer_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for the optimizer, e.g. ``{"betas": [0.9, 0.95]}`` for ``adamw`` or ``{"alpha": 0.9}`` for your own."""
    loss: Union[Loss, str] = "cross_entropy"
    """``cross_entropy``, ``mse``, ``l1``, ``bce_with_logits``, ``smooth_l1`` or ``pkg.module:function``, called as ``function(outputs, targets)``, returning the MEAN loss over the batch as a scalar tensor. Every strategy applies it where it computes the loss (``dp_balanced`` per device, the pipeline on its last stage, ``ddp2`` on the node's whole batch)."""
    metrics: Optional[list] = None
    """A list of names (``accuracy``, ``top5``, ``mae``, ``mse``) or ``pkg.module:function`` entries, each called as ``function(outputs, targets)``, returning ``(sum, count)`` for the batch; reported per epoch as ``train_<name>``/``test_<name>`` (a function's own name), exact over all ranks and devices. None: ``accuracy`` for a classification dataset, none when its ``num_classes`` is None."""

    train_step: Optional[str] = None
    """Your own training step: ``fn(model, batch, ctx)`` returning the loss, or a dict with ``loss`` and extra scalars (reported per epoch as ``train_<name>``, like built-in metrics); ``batch`` is ``(inputs, targets)`` on the device, ``ctx`` has ``rank``, ``world_size``, ``epoch``, ``step``, ``device``, ``precision``, ``loss`` (the config's loss function) and ``metrics``. The engine keeps autocast, the grad scaler, accumulation and DDP's ``no_sync``, clipping, the optimizer and schedule, checkpoints. From Python the function itself, or ``pkg.module:function``; every data-parallel strategy (docs/your-own-code.md: Your own training step)."""
    param_groups: Optional[str] = None
    """Parameter groups for the optimizer: ``no_decay_norm_bias`` (no weight decay on biases and normalisation weights), or ``fn(model) -> list[dict]`` (each dict's ``params`` a list of parameters or of their names, with per-group options such as ``lr``); None: one group. Frozen parameters (``requires_grad=False``) are always left out."""
    init_from: Optional[str] = None
    """Weights to start from: a ``.pt``/``.safetensors`` file, another run's folder (its newest checkpoint) or a checkpoint folder of any strategy; a resume of this run wins over it (docs/your-own-code.md: Fine-tuning)."""
    init_strict: bool = True
    """``init_from``: every key must match the model; False loads the keys whose name and shape match (a new head) and reports the rest."""
    save: SaveWhat = "full"
    """What a checkpoint's model part holds: ``full``, or ``trainable`` (the parameters with ``requires_grad`` and the buffers, for adapter-style fine-tuning; the frozen weights come back from ``init_from`` or the model's builder on a resume)."""
    lora: Optional[dict] = None
    """LoRA adapters on an ``hf:`` model with peft, e.g. ``{"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}``: the base frozen, the adapters trained (``ddp``, ``fsdp``); checkpoints hold the adapters (``save="trainable"``); ``export(format="peft")`` writes the adapter folder."""

    # --- DDP and model options
    find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step."""
    static_graph: bool = False
    """DDP: the set of used parameters never changes (enables more overlap)."""
    bucket_cap_mb: Optional[float] = None
    """DDP: gradient bucket size (torch default 25)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the buckets (saves one copy)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm to SyncBatchNorm (statistics over the global batch)."""
    compile: Compile = False
    """``True``: wrap the model in ``torch.compile`` (after DDP or FSDP wrapping, as Lightning's Fabric does). ``"blocks"``: compile each block in place instead (``nn.Module.compile``; blocks as ``activation_checkpointing`` finds them), as torchtitan does: DDP's all-reduces and FSDP's all-gathers stay outside the compiled graphs, and the state dict keeps its names. Refused: ``"blocks"`` by ``dp``/``dp_balanced``/``ddp2`` (DataParallel copies the model each step), either by ``pipeline``/``ddp_pipeline`` (not supported yet)."""
    channels_last: bool = False
    """Use the channels-last memory format for 4-D inputs and the model."""
    shard_group_size: Optional[int] = None
    """``fsdp``: the workers that shard the model among themselves (HSDP): groups of this many consecutive ranks each hold one sharded copy, and the groups average gradients as DDP replicas do. Set it to the workers of one node so that the all-gathers stay inside nodes and only the gradient all-reduce crosses them. None: one group of all workers (plain FSDP)."""
    cpu_offload: bool = False
    """``fsdp``: keep the parameter shards, their gradients and the optimizer state in host memory (FSDP2's ``CPUOffloadPolicy``): each block is copied to the device for its forward and backward and the optimizer steps on the CPU. The device then holds about two blocks whole, for a slower step (host-device copies, a CPU optimizer)."""
    tensor_parallel_size: int = 1
    """``fsdp``, ``ddp``: split each layer's weights over groups of this many consecutive workers (tensor parallel, ``torch.distributed.tensor``): the workers form a 2-D mesh, data parallel x tensor, FSDP shards (or DDP replicates) over the first dimension, and the workers of one group see the same batch (``num_workers / tensor_parallel_size`` replicas split the global batch). Each group must be inside one node. 1: off (docs/strategies.md: Tensor parallel)."""
    tensor_parallel_plan: Optional[dict] = None
    """Your tensor-parallel plan: module path (``*`` matches one level, ``layers.*.attn.q``) to style, one of ``colwise``, ``rowwise``, ``sequence_parallel``, ``colwise_gather_output``, ``embedding_rowwise``. None: the model's own (``transformer_lm``'s, or a Hugging Face model's ``_tp_plan``)."""
    tensor_parallel_across_nodes: bool = False
    """Let a tensor group span nodes (an inter-node link fast enough for every layer's collectives, which you have measured): where the nodes cannot hold the groups whole, the driver and the workers warn instead of refusing."""
    activation_checkpointing: int = 0
    """Recompute every k-th block's activations in the backward pass instead of keeping them (k=1: every block; 0: off): less activation memory for one more forward of those blocks, the same gradients. Blocks as ``mp`` and the pipeline split them (an ``nn.Sequential``'s children, or ``blocks()``); every strategy."""
    collective_timeout_s: float = 1800.0
    """A collective that waits longer than this fails (names the stuck rank) instead of hanging."""
    stall_timeout_s: Optional[float] = None
    """A rank that makes no progress this long while the others have gone further (or whose heartbeats stop) is named on the driver with its node, step, what it was doing and its Python stacks, and the attempt fails, so the retry policy applies (docs/reliability.md: A stuck rank). None: ``max(120 s, 20 x the median step time)``; 0: off (``collective_timeout_s`` stays the backstop). Ray runs of two or more processes."""
    placement_timeout_s: float = 900.0
    """How long the workers (pipeline stages) may wait for their resources to be granted (an autoscaling cluster starting nodes) before the run fails naming what is pending and the node types known."""

    # --- run, storage and failures
    seed: int = 0
    """Seeds initial weights, shuffling and synthetic data."""
    name: Optional[str] = None
    """Run name; a run started again with the same name and ``storage_path`` resumes (``resume``). None: ``<model>-<dataset>-<strategy>``."""
    resume: Resume = "auto"
    """A run started again under its name: ``auto`` resumes from its newest checkpoint if it has one (a finished run started with settings that would change its training is refused, naming them), ``never`` refuses a folder that holds checkpoints (a script that must start fresh), ``must`` refuses one that holds none (a script that must continue)."""
    storage_path: str = "~/raytrain_results"
    """Where checkpoints and history go: a shared folder or a ``s3://``/``gs://`` URI for multi-node."""
    max_failures: int = 0
    """Restarts of the worker group after a failure (each resumes from the last checkpoint)."""
    fault_tolerance: FaultTolerance = "restart"
    """What a lost worker costs: ``restart`` restarts the whole worker group from the last checkpoint; ``replica_groups`` (``ddp``, torchft through Ray Train's ``TorchftConfig``: the ``[ft]`` extra) replaces only the lost worker while the others train on, and the replacement takes a live worker's state (docs/reliability.md: Replica groups)."""
    num_checkpoints_to_keep: int = 2
    """Older checkpoints are deleted."""
    checkpoint_every_n_steps: Optional[int] = None
    """Also checkpoint every this many optimizer steps inside an epoch; a resume continues mid-epoch (spot nodes)."""
    checkpoint_every_n_minutes: Union[float, Literal["auto"], None] = None
    """Also checkpoint inside an epoch once this many minutes have passed since the last checkpoint (every rank agrees at the same step: the clock is compared every 10 steps). ``auto``: Young-Daly's interval ``sqrt(2 C M)`` from this attempt's mean stall per save ``C`` and the run's mean time between reclaims ``M = 3600 / (GPUs x expected_reclaims_per_gpu_hour)`` (workers on CPU), re-computed after each save; before the first save, 10 minutes or the first epoch's end (docs/reliability.md: Goodput and checkpoint intervals)."""
    expected_reclaims_per_gpu_hour: Optional[float] = None
    """``checkpoint_every_n_minutes="auto"``: the reclaims (failures) you expect per GPU per hour, e.g. 0.05; ``raytrain-mgpu goodput RUN`` projects what a rate costs."""
    on_nonfinite: OnNonfinite = "stop"
    """A NaN or infinite loss: ``stop`` ends the run at the end of that epoch (or the next checkpoint) with an error naming the first such step, before any checkpoint of those weights; ``skip`` skips optimizer steps whose gradients are not finite on any rank (one host read a step, as fp16's scaler does) and stops after ``max_skipped_steps`` in a row; ``ignore`` trains on. No checkpoint with non-finite weights is ever written."""
    max_skipped_steps: int = 10
    """``on_nonfinite="skip"``: this many non-finite steps in a row end the run."""
    eval_every_n_steps: Optional[int] = None
    """Also evaluate every this many optimizer steps (the validation split if there is one, else the test split), reported as per-step scalars ``val/loss`` (``test/loss``) and ``val/<metric>``."""
    profile_steps: Optional[Tuple[int, int]] = None
    """``(first, last)`` global steps to record with ``torch.profiler``: one trace per rank in ``<run>/profile`` (TensorBoard's profiler plugin and Perfetto open it)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (and always after the last): the validation split when there is one, else the test split."""
    val_fraction: Optional[float] = None
    """Hold out this fraction of the training split as the validation split (``val_*`` keys), chosen by ``seed`` before any sharding, so the same on every worker count; a dataset factory may return ``Datasets(..., val=...)`` instead. With a validation split, ``monitor``, ``keep_best`` and early stopping rank epochs on it and the test split is evaluated after the last epoch only."""
    test_every_epoch: bool = False
    """With a validation split: evaluate the test split on every evaluated epoch too, not only after the last (its scores are for reading, never for choosing)."""
    address: Optional[str] = None
    """Ray cluster to use; default ``RAY_ADDRESS`` or a new local instance."""
    runner: Runner = "auto"
    """Where the run trains: ``local`` in the driver's own process (one worker, no Ray: starts in seconds), ``ray`` on Ray Train's workers (or the pipeline's actor group), ``auto`` in-process where the run needs nothing only Ray provides (one worker of a strategy that trains in one process, no cluster address, no Ray Data, not elastic), else on Ray (docs/reliability.md: Where a run trains)."""
    verbose: bool = False
    """Show Ray's own per-worker logs on the driver."""
    max_preemption_failures: int = -1
    """Restarts after a node preemption (a drain with reason preemption: a spot reclaim), counted apart from ``max_failures``; -1: unlimited. Each resumes from the checkpoint saved on the notice (``checkpointing/preemption.py``)."""
    preemption_grace_s: float = 0.0
    """How long Ray Train lets the surviving workers run past a preemption's deadline before it restarts the group (Ray's ``FailureConfig.preemption_grace_s``)."""

    # --- checkpoints: the best one and early stopping
    monitor: Optional[str] = None
    """History key that ranks epochs, e.g. ``val_loss`` or ``val_accuracy`` with a validation split, else ``test_loss`` or ``test_accuracy`` (measured on evaluated epochs only); None: no best tracking."""
    mode: MonitorMode = "auto"
    """How ``monitor`` ranks epochs: ``auto`` follows the key (accuracy and top5 maximised; losses, ``mae`` and ``mse`` minimised; your metric function says with a ``higher_is_better`` attribute); ``max``: higher is better; ``min``: lower is better."""
    keep_best: bool = False
    """Keep the checkpoint of the best ``monitor`` besides the last ``num_checkpoints_to_keep`` (``TrainResult.best_checkpoint_path``, ``load_model(best=True)``)."""
    early_stopping_patience: Optional[int] = None
    """Stop after this many evaluated epochs in a row without a strictly better ``monitor``; None: train all ``epochs``."""

    # --- watching a run: loggers and callbacks
    log_every_n_steps: int = 50
    """Rank 0 sends per-step scalars (``train/loss``, ``train/lr``, ``train/grad_norm`` when clipping, ``train/samples_per_s``, ``train/data_wait_share``) every this many optimizer steps; read from the device once per N steps, never per step."""
    loggers: list[Logger] = field(default_factory=list)
    """Where the run's scalars also go, any of ``tensorboard`` (event files under ``<run>/tensorboard``; ``pip install raytrain-mgpu[tensorboard]``), ``mlflow`` (one MLflow run per training run, resumed with it; ``pip install raytrain-mgpu[mlflow]``), ``csv`` (``<run>/metrics.csv``: step, epoch, name, value), ``wandb`` (one Weights & Biases run per training run, resumed with it; ``WANDB_PROJECT`` and W&B's other variables apply; ``pip install raytrain-mgpu[wandb]``)."""
    mlflow_tracking_uri: Optional[str] = None
    """``loggers=["mlflow"]``: the MLflow tracking URI, e.g. ``http://mlflow:5000``; None: a file store in ``<run>/mlruns`` (local storage only)."""
    callbacks: list = field(default_factory=list)
    """Your driver-side hooks: ``pkg.module:Class`` entries (built with no arguments) or, from Python, ``raytrain_mgpu.driver.callbacks.Callback`` instances; called on ``on_train_start``, ``on_step``, ``on_epoch_end``, ``on_checkpoint``, ``on_train_end``. An exception in one fails the run, naming it."""

    def __post_init__(self) -> None:
        self._unused_options = validate(self)  # {option: value} the strategy never reads
        warn_unused(self._unused_options, self.strategy, stacklevel=4)  # 4: the line that built the config (past the __init__ that names unknown fields)

    # ------------------------------------------------------------------ sections

    @property
    def data(self) -> DataConfig:
        return self._section(DataConfig)

    @property
    def optim(self) -> OptimConfig:
        return self._section(OptimConfig, lr=float(self.lr))

    @property
    def parallel(self) -> ParallelConfig:
        return self._section(ParallelConfig)

    def _section(self, cls, **converted: Any):
        """``cls`` filled by keyword from the fields of the same names; ``converted``: values that differ."""
        values = {f.name: getattr(self, f.name) for f in fields(cls) if f.name not in converted}
        return cls(**values, **converted)

    # ------------------------------------------------------------------ I/O

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "TrainConfig":
        """Build from a mapping; unknown keys are an error that lists the valid ones."""
        if not isinstance(values, dict):
            raise ValueError(f"{source}: expected a mapping of TrainConfig fields, got "
                             f"{type(values).__name__}. Write one `key: value` per line.")
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise unknown_fields(unknown, cls.field_names(), source, "key")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: Union[str, Path], allow_code: bool = False, **overrides: Any) -> "TrainConfig":
        """Read a YAML mapping of fields; ``overrides`` win over the file.

        A config file can name code (``model: my_models:build``), so it is treated like
        code: such a factory is refused unless ``allow_code=True`` or its module is listed
        in ``RAYTRAIN_MGPU_TRUSTED_MODULES`` (see ``config/factories.py``). ``overrides`` are the
        caller's own and are not restricted.
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist. Pass the path of a YAML file.")
        try:
            values = _yaml.load(path.read_text())  # YAML 1.2's numbers: lr: 1e-3 is 0.001
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ValueError(f"config file {str(path)!r}: expected a mapping of TrainConfig fields, got "
                             f"{type(values).__name__}. Write one `key: value` per line.")
        entries = {}  # list fields: each entry may name code
        for name in ("metrics", "callbacks"):
            listed = values.get(name)
            entries.update({f"{name}[{i}]": m for i, m in enumerate(listed)} if isinstance(listed, list) else {})
        for name in ("train_transform", "test_transform"):  # their code parts ("resize:96" is a recipe)
            entries.update({f"{name}[{i}]": m for i, m in enumerate(factory_parts(values.get(name)))})
        check_file_factories({**values, **entries}, (*CODE_FIELDS, *entries), str(path),
                             allow_code)
        return cls.from_dict({**values, **overrides}, source=str(path))

    def code_specs(self) -> list:
        """Every field value that may name user code (``pkg.module:function``): the workers get those modules."""
        return [*(getattr(self, name) for name in CODE_FIELDS), *(self.metrics or []),
                *factory_parts(self.train_transform), *factory_parts(self.test_transform)]

    def to_dict(self) -> dict:
        """The fields as plain data; a class or function from Python as its record (``_factory.code_record``:
        qualified name and source hash), which is what a run folder keeps and compares on a resume."""
        values = dataclasses.asdict(self)
        for key, value in values.items():
            if isinstance(value, tuple):
                values[key] = list(value)
        for key in (*CODE_FIELDS, "train_transform", "test_transform"):
            values[key] = code_record(values[key])
        for key in ("metrics", "callbacks"):
            if isinstance(values[key], list):
                values[key] = [code_record(entry) for entry in values[key]]
        return values

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes``, normalised and validated like a new config.

        Warns only about options the changes leave unused (or set to another unused
        value): the original already warned about its own when it was built.
        """
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise unknown_fields(unknown, self.field_names(), "TrainConfig.replace()")
        new = copy.copy(self)
        vars(new).update(changes)
        new._unused_options = validate(new)
        warned = self._unused_options
        fresh = {k: v for k, v in new._unused_options.items() if k not in warned or warned[k] != v}
        warn_unused(fresh, new.strategy, stacklevel=2)  # 2: the line that called replace
        return new
