"""Checks that fail in seconds, before Ray Train schedules anything.

``ray.init(address=...)`` retries for minutes when nothing answers at the address (over
5 minutes measured with Ray 2.60), and a cluster that refuses the client's token shows
up as the same generic "Failed to connect" after 20 s. A local ``storage_path`` that only
the head node has is noticed by Ray Train when the first checkpoint is uploaded, after a
whole epoch of work. The checks here say what is wrong at once:

- :func:`probe_ray_address`: one gRPC call to the cluster's GCS (3 s at most) tells
  "nothing there" from "wrong or missing token";
- :func:`check_storage_reachable`: one zero-CPU task per alive node checks that the node
  sees a marker file the driver just wrote, and can write next to it;
- :func:`check_run_folder`: a run folder holding checkpoints trained with other settings
  (model, data and its split size, strategy, optimizer, global batch, ...) is refused
  whichever runner wrote them; the settings are recorded in ``run.json``. Each runner only looks for its own checkpoints
  (Ray Train's snapshot, the pipeline's ``checkpoint_epoch*``), so without this a
  ``pipeline`` run started over silently in a ``ddp`` run's folder and replaced its
  ``history.parquet``; ``resume="never"``/``"must"`` refuse a folder with/without a checkpoint
  (``driver/rerun.py``: also the other settings a run started again changes);
- :func:`check_model_builds`: the model is built on the ``meta`` device (no memory, no
  weights) and its optimizer over it, so a model or optimizer factory that raises, or
  ``model_kwargs``/``optimizer_kwargs`` it does not take, fail on the driver, named, instead of
  on every worker after Ray has started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid
from typing import List, Optional, Tuple

import pyarrow.fs as pafs
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_mgpu.config.factories import code_name
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.checkpointing.files import filesystem
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.data import digits, parquet, synthetic, text
from raytrain_mgpu.data.base import validation_size
from raytrain_mgpu.data.ray_datasets import RayDataSplits
from raytrain_mgpu.driver.rerun import check_resume
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.models import build_model_shapes
from raytrain_mgpu.models.checkpointing import checkpoint_blocks, compile_blocks
from raytrain_mgpu.models.huggingface import check_source, is_hf
from raytrain_mgpu.models.lora import check_targets

logger = logging.getLogger(__name__)

__all__ = ["probe_ray_address", "check_storage_reachable", "check_run_folder", "check_data_fits", "run_identity",
           "check_model_builds"]

_PROBE_TIMEOUT_S = 3.0
_TOKEN_FIX = ("The cluster runs with token authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH "
              "to a file holding the cluster's token (on the head, `ray get-auth-token` prints it), or "
              "RAY_AUTH_TOKEN to the token itself.")


def probe_ray_address(address: Optional[str], timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Raise ``ConnectionError`` within ``timeout_s`` if no Ray cluster answers at
    ``address`` or it refuses this process's token. ``None``/``auto``/``local`` pass."""
    if not address or address in ("auto", "local"):
        return
    if address.startswith("ray://"):  # Ray Client: a plain TCP check of the client server
        _tcp_probe(address, address[len("ray://"):], timeout_s)
        return
    if "://" in address:
        raise ConnectionError(
            f"Ray address {address!r} (TrainConfig.address or RAY_ADDRESS) is not a cluster address. Use "
            f"the head's host:port (e.g. 10.0.0.1:6379) or ray://host:10001; an http:// address is the "
            f"dashboard, which `ray job submit --address` takes.")
    try:
        # late: Ray's private modules may move (an ImportError: ray.init's own checks apply instead)
        import grpc
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple)
        from ray._private import ray_constants
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError as exc:  # private Ray modules moved: fall back to ray.init's own checks
        logger.debug("skipping the Ray address probe: %s", exc)
        return
    try:
        metadata = _get_authentication_metadata_tuple()
    except Exception:  # ray.exceptions.AuthenticationError: token mode, but no token here
        raise ConnectionError(f"cannot connect to the Ray cluster at {address!r}: token authentication is "
                              f"on (RAY_AUTH_MODE=token) but this process has no token. {_TOKEN_FIX}") from None
    # Ray's own channel options (HTTP proxies off unless RAY_grpc_enable_http_proxy=1).
    options = list(getattr(ray_constants, "GLOBAL_GRPC_OPTIONS", ()))
    with grpc.insecure_channel(address, options=options) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                sent = "a token that it does not accept" if metadata else "no token"
                raise ConnectionError(f"the Ray cluster at {address!r} refused the connection: this process "
                                      f"sent {sent} ({details}). {_TOKEN_FIX}") from None
            raise ConnectionError(
                f"no Ray cluster answers at {address!r} (TrainConfig.address or RAY_ADDRESS) within "
                f"{timeout_s:g} s ({code.name}: {details}). Check the address and that the cluster is "
                f"running (`ray status --address {address}`), or unset RAY_ADDRESS and "
                f"TrainConfig.address to start a local Ray instance.") from None


def _tcp_probe(address: str, host_port: str, timeout_s: float) -> None:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"no Ray client server answers at {address!r} within {timeout_s:g} s ({exc}). "
                              f"Check the address and that the cluster is running.") from None


# ----------------------------------------------------------------------------- storage


def check_storage_reachable(storage_path: str, timeout_s: float = 120.0) -> None:
    """Raise ``ValueError`` if some alive node cannot read and write ``storage_path``.

    Needs a connected Ray. On a single node there is nothing to check (Ray Train writes
    the path on the first report). Nodes that join later (autoscaling) are checked by each
    worker there before its first step (``transports/base.check_writable``)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return
    fs, root = filesystem(storage_path)
    marker = f"{root.rstrip('/')}/.raytrain-mgpu-reach-{uuid.uuid4().hex[:12]}"
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(marker) as f:
        f.write(b"written by the driver; each node checks that it sees this file\n")
    try:
        problems = _probe_nodes(nodes, storage_path, marker, timeout_s)
    finally:
        fs.delete_file(marker)
    if problems:
        where = "; ".join(f"node {ip}: {why}" for ip, why in problems)
        raise ValueError(
            f"TrainConfig.storage_path={storage_path!r} is not reachable from every node of the Ray cluster "
            f"({where}). Workers there could not save checkpoints; Ray Train would only notice after the "
            f"first epoch. Use a folder that every node mounts at the same path (NFS, EFS, a shared disk) "
            f"or a bucket URI such as s3://bucket/runs that every node has credentials for.")


def _probe_nodes(nodes: list, storage_path: str, marker: str, timeout_s: float) -> List[Tuple[str, str]]:
    probe = ray.remote(num_cpus=0, max_retries=0)(_node_sees_storage)
    refs = {n["NodeManagerAddress"] + (f" ({n['NodeID'][:8]})" if _duplicate_ips(nodes) else ""):
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(storage_path, marker)
            for n in nodes}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    problems = []
    for name, ref in refs.items():
        if ref in pending:
            logger.warning("storage check: node %s did not answer within %.0f s; not checked", name, timeout_s)
            ray.cancel(ref, force=True)
            continue
        why = ray.get(ref)
        if why:
            problems.append((name, why))
    return problems


def _duplicate_ips(nodes: list) -> bool:
    ips = [n["NodeManagerAddress"] for n in nodes]
    return len(set(ips)) < len(ips)


def _node_sees_storage(storage_path: str, marker: str) -> Optional[str]:
    """Runs on one node: None if it sees ``marker`` and can write beside it, else why not."""
    try:
        fs, _ = filesystem(storage_path)
        if fs.get_file_info(marker).type != pafs.FileType.File:
            return (f"does not see {marker} that the driver wrote (a local folder on the driver's machine, "
                    f"or a different mount)")
        probe = f"{marker}.{socket.gethostname()}.{os.getpid()}"
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
        return None
    except Exception as exc:  # permissions, credentials, a missing bucket: all worth reporting
        return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- run folder


RUN_RECORD = "run.json"
IDENTITY_FIELDS = ("model", "model_kwargs", "lora", "dataset", "num_samples", "image_column", "label_column",
                   "strategy", "optimizer", "batch_size", "num_stages", "seed")
"""What a run is trained with; a resume that changes one of these is refused.

Everything else may change on a resume, because a resume legitimately changes it:
``epochs``/``max_steps`` (extend a run), ``lr`` and its schedule, ``max_failures``,
``verbose``, ``address``, ``num_workers``/``grad_accum_steps`` (the global batch stays),
``precision``, ``collective_timeout_s``, ``num_checkpoints_to_keep``, ``data_root`` (the
same data at another mount: its shape, classes and split size are compared instead).
Such a change is named (``driver/rerun.training_changes``): on a resume in one line, and a
finished run, which would not train with it, refuses it."""


def run_identity(cfg, data_info: Optional[dict] = None) -> dict:
    """The identity fields of ``cfg`` plus the data's shape, classes and split size."""
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    identity = {k: values.get(k) for k in IDENTITY_FIELDS}
    return redact({**identity, **{f"data.{k}": v for k, v in (data_info or {}).items()}})


def check_run_folder(cfg, data_info: Optional[dict] = None) -> None:
    """Raise ``ValueError`` if ``{storage_path}/{name}`` holds checkpoints of a run trained
    with other identity fields (``IDENTITY_FIELDS`` and the data's shape, classes and split
    size), whichever runner wrote them; else record this run's identity in ``run.json``. Also
    ``TrainConfig.resume``: ``never`` refuses a folder with a checkpoint, ``must`` one without.

    ``data_info``: ``{"input_shape": [...], "num_classes": n, "train_split_size": n}``."""
    folder = RunFolder.of(cfg)
    newest = folder.newest_checkpoint()
    check_resume(cfg, folder.display, newest)  # before run.json is written: a refused run leaves no trace
    mine = run_identity(cfg, data_info)
    if newest is not None:
        recorded = folder.read_json(folder.join(RUN_RECORD))
        if recorded is None:  # a run folder from before run.json: the newest checkpoint's config
            meta = newest.meta
            data = {k: meta[k] for k in ("input_shape", "num_classes") if k in meta}
            recorded = run_identity(meta.get("config") or meta, data)
        _compare_identity(recorded, mine, folder.display)
    folder.write_json(RUN_RECORD, mine)


def _compare_identity(recorded: dict, mine: dict, run: str) -> None:
    differences = [f"trained with {key}={recorded[key]!r}, but this run has {key}={mine.get(key)!r}"
                   for key in sorted(recorded)
                   if key in mine and recorded[key] is not None and _norm(recorded[key]) != _norm(mine[key])]
    if differences:
        raise ValueError(
            f"run folder {run!r} holds checkpoints {'; '.join(differences)}: resuming would mix two runs. Use another `name` (or storage_path) for a new run, or set these "
            f"back to resume. (epochs, lr, max_failures, ... may change on a resume.)")


def _norm(value):
    return json.loads(json.dumps(value, default=str))  # tuples vs lists, as JSON stores them


# ----------------------------------------------------------------------------- data


def train_split_size(data) -> Optional[int]:
    """Samples in the training split, less what ``val_fraction`` holds out, where that is known without
    reading the data (None: not known cheaply, e.g. a user factory or a fixed-size download)."""
    size = _whole_train_split_size(data)
    if size is None or data.val_fraction is None:
        return size
    return size - validation_size(size, data.val_fraction)


def _whole_train_split_size(data) -> Optional[int]:
    if isinstance(data.dataset, RayDataSplits):
        return data.dataset.num_train  # counted by fit (data/ray_datasets.take)
    if data.dataset == "digits":
        return len(digits.load_split()[1])  # 1797 images, 80% train; a fraction of a second
    if data.dataset == "synthetic":
        return data.num_samples or synthetic.DEFAULT_NUM_SAMPLES
    if data.dataset == "synthetic_text":
        return data.num_samples or text.DEFAULT_NUM_SAMPLES
    if data.dataset == "parquet":
        return parquet.train_split_size(data)  # footers only
    return None


def check_data_fits(cfg, num_classes: Optional[int]) -> Optional[int]:
    """Refuse a classification dataset with fewer than 2 classes (``num_classes`` None: not
    classification, e.g. regression) and a global batch larger than the training split (no
    full step per epoch; the workers would find out). Returns the split size, or None where
    it is not known cheaply."""
    if num_classes is not None and num_classes < 2:
        raise ValueError(f"TrainConfig.dataset={redact(cfg.dataset)!r}: the data has {num_classes} class(es); a "
                         f"classifier needs at least 2. Check the label column (label_column="
                         f"{cfg.label_column!r}) or num_classes.")
    size = train_split_size(cfg.data)
    if size is not None and cfg.batch_size > size:
        raise ValueError(f"TrainConfig.batch_size={cfg.batch_size}: the global batch is larger than the training "
                         f"split of {code_name(cfg.dataset)!r} ({size} samples), so an epoch has no full step. Set "
                         f"batch_size to {size} or less, or use more data.")
    return size


# ----------------------------------------------------------------------------- model


def check_model_builds(cfg, input_shape: tuple, num_classes: Optional[int]) -> None:
    """Build ``cfg``'s model on ``meta`` and its optimizer over it; errors name the factory and the fix."""
    if is_hf(cfg.model):  # its folder (URI, hub id) and config.json; the weights are the workers' to read
        check_source(cfg.model)
    model = build_model_shapes(cfg.model, input_shape, num_classes, cfg.model_kwargs)  # meta, else CPU
    if getattr(cfg, "lora", None) is not None:  # target_modules that name no module fail here, listing the Linears
        model = check_targets(model, cfg.lora, code_name(cfg.model))
    checkpoint_blocks(model, cfg.activation_checkpointing)  # a model without blocks is refused here, not on a worker
    if cfg.compile == "blocks":
        compile_blocks(model, dry_run=True)  # the same for compile="blocks"
    Objective.of(cfg, num_classes)  # a loss or metric factory that does not import fails here, named
    try:
        with _without_dynamo_import():
            build_optimizer(model.parameters(), cfg.optim)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"TrainConfig.optimizer={code_name(cfg.optimizer)!r} with optimizer_kwargs={cfg.optimizer_kwargs!r} "
                         f"does not build: {type(exc).__name__}: {exc}. Fix or remove the offending keys.") from exc


@contextlib.contextmanager
def _without_dynamo_import():
    """Build the check's optimizer without importing ``torch._dynamo``.

    ``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``, whose first call imports
    ``torch._dynamo`` (1.2 s on 2 cores, measured with cProfile: most of ``fit``'s checks) to keep the
    function out of compiled graphs. This check runs in no compiled graph, and the driver of a Ray run
    never builds an optimizer again: the wrapper's cache is filled with the plain function for the
    check alone. Measured: ``raytrain-mgpu bench-startup --num-workers 2``'s first step ~1 s earlier.
    Where torch's wrapper differs (no ``__wrapped__``), the import just happens.
    """
    plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if plain is None or hasattr(plain, "__dynamo_disable"):
        yield
        return
    setattr(plain, "__dynamo_disable", plain)  # the slot torch._compile._disable_dynamo caches in
    try:
        yield
    finally:
        delattr(plain, "__dynamo_disable")
