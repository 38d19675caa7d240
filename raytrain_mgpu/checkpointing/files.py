"""The checkpoint format shared by every strategy and the pipeline runner.

A checkpoint is one folder (a Ray Train checkpoint in the run's storage):

- ``meta.json``: format version, model, dataset, strategy, epoch, step, the config;
- ``history.json``: the per-epoch metrics so far (so a resumed run keeps its history);
- ``model*.pt``: one or more state-dict parts, keys in the *unsplit* model's namespace.
  Data-parallel strategies write one ``model.pt``; pipeline stages write
  ``model-stage{i}.pt``. Loading merges every part, so a pipeline checkpoint loads
  into the plain model and a plain one can be split again;
- ``train_state*.pt``: optimizer, LR schedule, grad scaler and RNG states;
- ``sharded/`` instead of ``model.pt`` and the optimizer's state, for a sharded strategy (``fsdp``):
  a ``torch.distributed.checkpoint`` (DCP) folder, ``{"model": ..., "optimizer": ...}``, each rank's
  shards in its own file (``__<rank>_0.distcp``), DCP's ``.metadata`` (rank 0) naming where each
  piece of each tensor is. No rank gathers the whole state (``keep_best``'s copy gathers the model
  alone, to rank 0); a resume on another number of
  workers reshards (DCP plans the reads); :func:`load_model_state` consolidates the model on demand.
  Each rank uploads its own files, so a sharded checkpoint (``sharded`` in ``meta.json``) is
  complete once ``.metadata`` and every file it names are there (:func:`sharded_files`).

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: a pickled file can run
code while loading, and a run folder is writable by whoever shares the storage, so a
planted file must be refused, not executed. DCP reads its ``.metadata`` with a plain
``pickle.load``: :func:`check_sharded_metadata` unpickles it first with only DCP's own
metadata classes allowed, and refuses anything else. Only the names above are read (a stray
``model_backup.pt`` is ignored, not merged into the weights).

Ray Train registers a checkpoint only after the whole folder is persisted, so a kill
during a save leaves the previous checkpoint as the one a resume picks up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional

import pyarrow.fs as pafs
import torch

from raytrain_mgpu.config.factories import code_record

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "meta.json"
HISTORY_FILE = "history.json"
# Our own part names only: "model.pt" (data parallel) and "model-stage{p}.pt" (pipeline).
_MODEL_PART_RE = re.compile(r"^model(-stage\d+)?\.pt$")
_TRAIN_STATE_PART_RE = re.compile(r"^(-stage\d+)?$")
SHARDED_DIR = "sharded"
"""A sharded strategy's DCP folder inside a checkpoint (model and optimizer, one file per rank)."""
SHARDED_KEY = "sharded"
"""meta.json's mark of a sharded checkpoint: complete once DCP's ``.metadata`` and every file it names are there."""


def write_checkpoint(directory: str, *, meta: dict, history: list, model_state: Optional[dict] = None,
                     train_state: Optional[dict] = None, part: str = "") -> None:
    """Write one checkpoint part into ``directory`` (``part`` e.g. ``"-stage1"``)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if model_state is not None:
        torch.save({k: v.detach().cpu() for k, v in model_state.items()}, path / f"model{part}.pt")
    if train_state is not None:
        torch.save(train_state, path / f"train_state{part}.pt")
    if meta is not None:
        (path / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=1))
    if history is not None:
        # One row a line: ``indent`` makes ``json`` fall back to its pure-Python encoder, and every
        # checkpoint (step ones too) rewrites the whole history: 187 rows took 27.7 ms indented,
        # 9.3 ms a row a line (measured on a 2-core machine).
        (path / HISTORY_FILE).write_text("[\n" + ",\n".join(json.dumps(row) for row in history) + "\n]\n")


def write_files(directory: str, files: dict) -> None:
    """``{file name: object}`` into ``directory``, each with ``torch.save`` (a model part's tensors detached, on CPU)."""
    if not files:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        if _MODEL_PART_RE.match(name):
            value = {k: v.detach().cpu() for k, v in value.items()}
        torch.save(value, path / name)


def read_meta(directory: str) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise ValueError(f"{directory!r} is not a raytrain-mgpu checkpoint: {META_FILE} is missing.")
    return json.loads(path.read_text())


def read_history(directory: str) -> list:
    path = Path(directory) / HISTORY_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def model_part_files(directory: str) -> list:
    """Our own model part files in ``directory``, sorted; other ``*.pt`` files are not ours."""
    return sorted(p for p in Path(directory).glob("model*.pt") if _MODEL_PART_RE.match(p.name))


def is_sharded(directory: str) -> bool:
    return (Path(directory) / SHARDED_DIR).is_dir()


def load_model_state(directory: str) -> dict:
    """Merge every ``model.pt`` / ``model-stage{p}.pt`` part into one state dict of the unsplit model
    (a sharded checkpoint: its model's shards consolidated, the optimizer's left on disk)."""
    if is_sharded(directory):
        return consolidate_sharded(directory, "model")
    parts = model_part_files(directory)
    if not parts:
        raise ValueError(f"checkpoint {directory!r} holds no model.pt or model-stage<p>.pt file; it may be "
                         f"incomplete.")
    state: dict = {}
    for part in parts:
        state.update(_load_tensors(part))
    return state


def consolidate_sharded(directory: str, key: str) -> dict:
    """The full tensors under ``key`` ("model" or "optimizer") of a sharded checkpoint, in this
    process (no process group): DCP reads each tensor's pieces from every rank's file."""
    # DCP's own reading of a checkpoint without the model, as format_utils.dcp_to_torch_save does it (the
    # public dcp.load fills a copy of an empty state dict), asked for one key: the optimizer's state
    # (twice the model's, AdamW) stays on disk.
    # late: torch.distributed.checkpoint takes 0.77 s to import; the driver (the api, export, plot) imports this
    # module and needs it only to read a sharded checkpoint (a rank has it already, through parallel/)
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(directory) / SHARDED_DIR
    check_sharded_metadata(path)
    state: dict = {}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state, storage_reader=FileSystemReader(str(path)),
                             planner=_EmptyStateDictLoadPlanner(keys={key}), no_dist=True)
    except (CheckpointException, Exception) as exc:  # a shard missing or cut short (a BaseException: DCP's own)
        raise ValueError(f"sharded checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); it may be incomplete. "
                         f"Delete that checkpoint folder to use the one before.") from None
    return state[key]


# What DCP's .metadata may hold: its own dataclasses and the torch types they carry.
_METADATA_GLOBALS = {
    "collections": {"OrderedDict"},
    "torch": {"Size", "device", "layout", "memory_format", "strided", "sparse_coo", "contiguous_format",
              "channels_last", "channels_last_3d", "preserve_format"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # the folder it was saved to
}
_METADATA_MODULES = ("torch.distributed.checkpoint.",)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        allowed = (module.startswith(_METADATA_MODULES) or name in _METADATA_GLOBALS.get(module, ())
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def sharded_files(metadata: bytes) -> Optional[set]:
    """The files (relative to ``sharded/``) a DCP ``.metadata``'s bytes name, ``.metadata`` itself
    included; None for bytes that are not DCP's metadata (cut short, or planted)."""
    import io

    try:
        loaded = _MetadataUnpickler(io.BytesIO(metadata)).load()
        return {".metadata", *(info.relative_path for info in loaded.storage_data.values())}
    except Exception:  # noqa: BLE001 - anything unreadable is an incomplete checkpoint, never an error here
        return None


def check_sharded_metadata(path) -> None:
    """Refuse a DCP ``.metadata`` (read by DCP with a plain ``pickle.load``) that holds anything but
    DCP's metadata classes and torch's sizes and dtypes, before DCP reads it."""
    metadata = Path(path) / ".metadata"
    try:
        with open(metadata, "rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"sharded checkpoint {str(path)!r} has no .metadata: it is incomplete. Delete that "
                         f"checkpoint folder to use the one before.") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise ValueError(
            f"checkpoint file {str(metadata)!r} holds objects other than torch.distributed.checkpoint's metadata "
            f"({exc}); it was refused without running it. A file raytrain-mgpu wrote never does this: delete "
            f"the folder, or train under another `name`.") from None


def load_train_state(directory: str, part: str = "") -> Optional[dict]:
    """Optimizer, LR schedule, scaler and RNG states of one part, or None when absent."""
    if not _TRAIN_STATE_PART_RE.match(part):
        raise ValueError(f"train state part {part!r} is not '' or '-stage<p>'.")
    path = Path(directory) / f"train_state{part}.pt"
    return _load_tensors(path) if path.is_file() else None


def _load_tensors(path: Path):
    # weights_only=True allows tensors, plain containers and numbers only (AdamW/SGD,
    # LambdaLR, GradScaler and RNG states are made of these): anything else is refused
    # before it is constructed, so a planted file never runs code.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise ValueError(
            f"checkpoint file {str(path)!r} holds objects other than tensors and plain containers "
            f"({first[0] if first else type(exc).__name__}); it was refused without running it. A file "
            f"raytrain-mgpu wrote never does this: delete the folder, or train under another `name`.") from None
    except (EOFError, RuntimeError) as exc:
        raise ValueError(f"checkpoint file {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); it "
                         f"may be cut short. Delete that checkpoint folder to resume from the one before.") from None


def check_resumable(meta: dict, model, strategy: str, directory: str) -> None:
    """A checkpoint of another model or strategy must not be resumed silently (``model``: a name, or a
    class or function, compared by its record: ``_factory.code_record``)."""
    model = code_record(model)
    if meta.get("model") != model:
        raise ValueError(
            f"checkpoint {directory!r} was trained with model={meta.get('model')!r}, but this run has "
            f"model={model!r}. Use another `name` (or storage_path) for a new run, or set model back.")
    if meta.get("strategy") != strategy:
        raise ValueError(
            f"checkpoint {directory!r} was written by strategy={meta.get('strategy')!r}, but this run "
            f"has strategy={strategy!r}: its optimizer state does not carry over. Use another `name` "
            f"for a new run (load the weights with TrainResult.load_model()), or set strategy back.")


def filesystem(path: str):
    """``(pyarrow FileSystem, path in it)`` for a local path or a storage URI."""
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


@contextlib.contextmanager
def local_checkpoint(path: str) -> Iterator[str]:
    """A local folder with the checkpoint at ``path`` (a local path or a storage URI; a
    remote one is downloaded into a temporary folder for the time of the ``with``)."""
    fs, inner = filesystem(path)
    if isinstance(fs, pafs.LocalFileSystem):
        yield inner
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-ckpt-") as directory:
        pafs.copy_files(inner, directory, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield directory
