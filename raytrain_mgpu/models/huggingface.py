"""Hugging Face models from their folders: ``model="hf:<path, URI or hub id>"``.

The folder is what ``save_pretrained`` writes (``config.json``, safetensors weights, one file or shards with their
``model.safetensors.index.json``) and, beside it, the tokenizer's files. It may be:

- a local folder (every node must see it at that path, as a shared file system gives it);
- a URI in the run's storage (``s3://``, ``gs://``, any file system pyarrow opens): copied once per node into a
  local cache (:data:`CACHE_ENV`), under a key of the URI and its files' sizes and times, so a folder changed in
  place is copied again;
- a hub id (``hf:org/name``, not an existing path): ``huggingface_hub.snapshot_download`` into the hub's own
  cache on each node (``HF_HOME``, ``HF_HUB_OFFLINE`` apply).

The class is the one the config's ``architectures`` names, else ``AutoModelForCausalLM``; its ``forward`` gets the
batch's ``x`` as ``input_ids`` and returns an output with ``logits`` (the built-in losses read them:
``objectives.logits_of``). ``model_kwargs`` override the config's fields (e.g. ``{"attention_dropout": 0.1}``).

Who reads what: the weights are read where training needs them, the workers (and ``TrainResult.load_model`` or
``export`` when asked). The driver's checks read ``config.json`` alone and build the model on the ``meta``
device (:func:`build` without ``pretrained``, or under ``torch.device("meta")``): no check before Ray reads a
weight, so the driver's memory does not grow with the model. Weights load as float32: they are the optimizer's
master weights, and ``precision`` sets the compute dtype.

With ``fsdp`` the weights take the strategy's own path (``parallel/replication.py``): rank 0 loads them on its CPU
(``from_pretrained``), the other ranks build from ``config.json`` on ``meta``, and rank 0's tensors reach every rank's
shards one at a time; the other ranks read no file, no device holds more than its shards and the largest tensor,
and rank 0's host holds one float32 copy while they are sent (accelerate's "CPU RAM efficient loading" does the
same). Each rank reading its own shards' slices from the safetensors files is not done: the builder would have to
know the sharding (a model here knows no distributed code, and the sharding step knows no files), LoRA's initial
``lora_A`` and the base's non-persistent buffers (rotary tables) would have to be made alike on every rank without
rank 0's copy, and transformers converts some checkpoints' tensors as it loads them (renamed keys, fused experts),
so a file's tensors are not always the parameters.

No torch or transformers at import: the config's name check imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from raytrain_mgpu.config.names import fail
from raytrain_mgpu.config.factories import HF_MODEL_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["HF_MODEL_PREFIX", "is_hf", "hf_source", "source_kind", "absolute", "check_name", "check_source",
           "config_folder", "model_folder", "build", "model_class", "save_tokenizer", "run_label", "CACHE_ENV",
           "TOKENIZER_FILES"]

CACHE_ENV = "RAYTRAIN_MGPU_HF_CACHE"
"""Where a node keeps the folders it copied from a storage URI (default ``~/.cache/raytrain_mgpu/hf``)."""
CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any of these beside ``config.json`` means the folder holds a tokenizer (``export(format="hf")`` writes it too)."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_COMPLETE = ".raytrain-mgpu-complete"  # written last into a cached copy: a copy cut short is never used
_LOCK_WAIT_S = 3600.0  # the longest a worker waits for another process of its node to finish copying a folder
_FORMS = "Write model='hf:<folder>' (config.json and weights), 'hf:s3://bucket/folder' or 'hf:org/name' (the hub)."


def is_hf(model) -> bool:
    return isinstance(model, str) and model.startswith(HF_MODEL_PREFIX)


def hf_source(model: str) -> str:
    """The folder, URI or hub id of ``hf:<...>`` (``~`` expanded for a local path)."""
    source = model[len(HF_MODEL_PREFIX):].strip()
    return source if "://" in source else os.path.expanduser(source) if source.startswith("~") else source


def source_kind(source: str) -> str:
    """``"uri"``, ``"local"`` (an existing path, or one written as a path: ``/``, ``.``, ``~``, more than one
    ``/``) or ``"hub"``."""
    if "://" in source:
        return "uri"
    if os.path.exists(source) or source.startswith(("/", ".", "~")) or not _HUB_ID.match(source):
        return "local"
    return "hub"


def absolute(model):
    """``hf:<a local path>`` absolute, ``~`` expanded (a worker's working folder and home are not the driver's);
    any other model as it is."""
    if not is_hf(model):
        return model
    source = hf_source(model)
    if source and source_kind(source) == "local":
        return HF_MODEL_PREFIX + os.path.abspath(source)
    return model


def run_label(model: str) -> str:
    """The model's part of a default run name, one plain folder name: ``hf.<the folder's or repo's last name>``."""
    return "hf." + (hf_source(model).rstrip("/").rsplit("/", 1)[-1] or "model")


def check_name(model: str) -> None:
    """The config's check (no file is read): ``hf:`` names something, and transformers is installed."""
    import importlib.util

    if not hf_source(model):
        fail("model", model, "names no Hugging Face folder", _FORMS)
    if importlib.util.find_spec("transformers") is None:
        fail("model", model, "is a Hugging Face model, which needs transformers", "pip install raytrain-mgpu[lm]")


def check_source(model: str) -> None:
    """Before Ray, on the driver: the folder is there with ``config.json`` and weights, the URI has
    ``config.json``, a hub model is cached where ``HF_HUB_OFFLINE=1`` (online, its ``config.json`` is fetched when
    the model is built on ``meta``). Reads no weight."""
    check_name(model)
    source = hf_source(model)
    kind = source_kind(source)
    if kind == "local":
        _check_local(model, source)
    elif kind == "uri":
        import pyarrow.fs as pafs  # late: 0.2 s of import; the config checks import this module

        fs, inner = _filesystem(model, source)
        if fs.get_file_info(f"{inner.rstrip('/')}/{CONFIG_FILE}").type != pafs.FileType.File:
            fail("model", model, f"{source} has no {CONFIG_FILE}, so it is not a Hugging Face model folder",
                 "Point at the folder save_pretrained wrote (config.json and model.safetensors in it).")
    else:
        _check_hub(model, source)


def _check_local(model: str, source: str) -> None:
    path = Path(source)
    if not path.exists():
        fail("model", model, f"the folder {source} does not exist (and is not a hub id of the form org/name)",
             "Check the path; every node must see it (a shared file system), or put it in storage: "
             "hf:s3://bucket/folder.")
    if not path.is_dir():
        fail("model", model, f"{source} is a file, not a Hugging Face model folder",
             "Point at the folder that holds it (config.json and model.safetensors).")
    if not (path / CONFIG_FILE).is_file():
        fail("model", model, f"the folder {source} has no {CONFIG_FILE}, so it is not a Hugging Face model folder",
             "Point at the folder save_pretrained wrote (for a hub snapshot: its snapshots/<revision> folder).")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        fail("model", model, f"the folder {source} holds no weights ({', '.join(WEIGHT_FILES)})",
             "Save the model with save_pretrained into it, or point at the folder that holds its weights.")


def _check_hub(model: str, source: str) -> None:
    try:
        import huggingface_hub  # late: optional dependency (transformers brings it)
    except ImportError:
        fail("model", model, "names a Hugging Face hub model, which needs huggingface_hub",
             "pip install raytrain-mgpu[lm] (transformers brings it), or point at a local folder.")
    from huggingface_hub.utils import LocalEntryNotFoundError  # late: optional dependency

    if _offline():
        try:
            huggingface_hub.snapshot_download(source, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError) as exc:
            fail("model", model, f"names the hub model {source!r}, which is not in this machine's hub cache, and "
                                 f"HF_HUB_OFFLINE=1 forbids downloading it ({type(exc).__name__})",
                 f"Download it once where there is network (huggingface-cli download {source}) into a cache every "
                 f"node shares (HF_HOME), or unset HF_HUB_OFFLINE, or point at a local folder: hf:/path/to/folder.")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _filesystem(model: str, source: str):
    import pyarrow.fs as pafs  # late: 0.2 s of import; the config checks import this module

    try:
        return pafs.FileSystem.from_uri(source)
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        fail("model", model, f"the URI cannot be opened ({type(exc).__name__}: {exc})",
             "Check the URI and this machine's credentials for it (the workers need them too).")


# ----------------------------------------------------------------------------- where the files are


def config_folder(model: str) -> str:
    """A local folder with the model's ``config.json`` (and, for a local folder or a cached copy, the rest): what
    building on ``meta`` reads. A URI's or hub model's ``config.json`` alone is fetched, never its weights."""
    source = hf_source(model)
    kind = source_kind(source)
    if kind == "local":
        return source
    if kind == "hub":
        from huggingface_hub import hf_hub_download  # late: optional dependency

        try:
            return os.path.dirname(hf_hub_download(source, CONFIG_FILE))
        except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors: not found, gated, offline, network
            fail("model", model, f"the config.json of hub model {source!r} cannot be fetched ({type(exc).__name__}: "
                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})",
                 "Check the id (org/name), set HF_TOKEN for a gated or private model, or point at a local folder.")
    fs, inner = _filesystem(model, source)
    cached = _cache_root() / _cache_key(fs, inner, source)
    if (cached / _COMPLETE).is_file():
        return str(cached)
    folder = _cache_root() / f"config-{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    with fs.open_input_stream(f"{inner.rstrip('/')}/{CONFIG_FILE}") as stream:
        data = stream.read()
    _write_atomic(folder / CONFIG_FILE, data)
    return str(folder)


def model_folder(model: str) -> str:
    """A local folder with everything (weights and tokenizer): the folder itself, this node's cached copy of a URI
    (copied now if it has none), or the hub's snapshot (downloaded into the hub's cache if missing)."""
    source = hf_source(model)
    kind = source_kind(source)
    if kind == "local":
        return source
    if kind == "hub":
        from huggingface_hub import snapshot_download  # late: optional dependency

        return snapshot_download(source)
    fs, inner = _filesystem(model, source)
    return str(_cached_copy(fs, inner, source))


def _cache_root() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or "~/.cache/raytrain_mgpu/hf").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _cache_key(fs, inner: str, source: str) -> str:
    """The URI and every file's path, size and modification time: another folder, or this one changed, is
    another key (one listing of the folder)."""
    import pyarrow.fs as pafs  # late: 0.2 s of import; the config checks import this module

    listing = fs.get_file_info(pafs.FileSelector(inner.rstrip("/"), recursive=True))
    files = sorted((info.path, info.size, str(info.mtime)) for info in listing if info.type == pafs.FileType.File)
    return hashlib.sha256(json.dumps([source, files]).encode()).hexdigest()[:24]


def _cached_copy(fs, inner: str, source: str) -> Path:
    """This node's copy of the folder at ``source``: one process of the node copies it (the others wait on a
    lock, at most :data:`_LOCK_WAIT_S`), into a temporary folder renamed into place, ``_COMPLETE`` last."""
    import fcntl

    import pyarrow.fs as pafs  # late: 0.2 s of import; the config checks import this module

    root = _cache_root()
    target = root / _cache_key(fs, inner, source)
    if (target / _COMPLETE).is_file():
        return target
    with open(root / f"{target.name}.lock", "w") as lock:
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > _LOCK_WAIT_S:
                    raise TimeoutError(f"waited {_LOCK_WAIT_S:.0f} s for another process of this node to copy "
                                       f"{source} into {target}; remove {lock.name} if no process copies it.")
                time.sleep(1.0)
        if not (target / _COMPLETE).is_file():
            logger.info("copying %s into this node's cache %s", source, target)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
            try:
                pafs.copy_files(inner, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
                (tmp / _COMPLETE).write_text(source + "\n")
                shutil.rmtree(target, ignore_errors=True)  # a copy cut short before _COMPLETE
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- building


def build(model: str, model_kwargs: dict, pretrained: bool = False, num_classes: Optional[int] = None):
    """The model of ``hf:<...>``: with ``pretrained`` (and not under ``torch.device("meta")``) its folder's weights
    (``from_pretrained``, float32); otherwise built from ``config.json`` alone on the current default device
    (``meta`` for the driver's checks: no memory; elsewhere random weights). ``num_classes``: the dataset's
    vocabulary, which must fit the model's embeddings."""
    # late: loads torch, which the config checks need none of; transformers is an optional dependency
    import torch
    import transformers

    on_meta = torch.get_default_device().type == "meta"
    load = pretrained and not on_meta
    folder = model_folder(model) if load else config_folder(model)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, **model_kwargs)
    except (OSError, ValueError, KeyError) as exc:
        fail("model", model, f"its {CONFIG_FILE} cannot be read by transformers ({type(exc).__name__}: {exc})",
             "Point at a folder save_pretrained wrote, with a transformers version that knows its model_type.")
    vocab = getattr(config, "vocab_size", None)
    if num_classes is not None and isinstance(vocab, int) and num_classes > vocab:
        fail("model", model, f"its vocabulary holds {vocab} tokens, but the dataset's has {num_classes} "
                             f"(num_classes): token ids past {vocab - 1} have no embedding",
             "Tokenize with the model's own tokenizer (its folder's), or use a model of that vocabulary.")
    cls = model_class(config)
    if load:
        return cls.from_pretrained(folder, config=config, dtype=torch.float32)
    if cls is transformers.AutoModelForCausalLM:
        return cls.from_config(config)
    return cls(config)


def model_class(config):
    """The class ``config.architectures`` names (a transformers class), else ``AutoModelForCausalLM``."""
    import transformers  # late: optional dependency

    names = getattr(config, "architectures", None) or []
    found = getattr(transformers, names[0], None) if names else None
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
        return found
    return transformers.AutoModelForCausalLM


def save_tokenizer(model: str, out: str) -> bool:
    """The tokenizer of ``hf:<...>``'s folder into ``out``, as ``AutoTokenizer`` loads and saves it; False where
    the folder holds none."""
    folder = model_folder(model)
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        logger.info("%s holds no tokenizer: the export has the model's files alone", model)
        return False
    from transformers import AutoTokenizer  # late: optional dependency

    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return True
