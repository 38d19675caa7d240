"""Weights out: a checkpoint as ``model.safetensors`` + ``config.json``, or a Hugging Face folder.

A checkpoint of any strategy holds the unsplit model's state (pipeline parts merged, a sharded
one consolidated on the driver, without a GPU or process group: ``checkpoint.load_model_state``),
so every export is the plain model's state dict:

- ``fmt="safetensors"``: ``model.safetensors`` (contiguous CPU tensors; tensors that share memory,
  e.g. tied embeddings, are written once under each name, so any reader gets every key) and
  ``config.json``: what the run recorded (model, input shape, classes, epoch, step, the
  ``TrainConfig`` fields as ``meta.json`` holds them, credentials redacted);
- ``fmt="hf"``: a ``transformers.PreTrainedModel``'s ``save_pretrained`` folder (its own
  ``config.json`` and safetensors), the checkpoint's weights loaded into the given model first, and
  the run's record beside it as ``raytrain_mgpu.json``; a LoRA run's adapters merged into the base
  (``merge_and_unload``), and an ``hf:`` model's tokenizer saved beside it, so ``AutoModelForCausalLM`` and
  ``AutoTokenizer.from_pretrained`` load the folder;
- ``fmt="peft"``: a LoRA run's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``: peft's
  ``save_pretrained``), which ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base model; its
  ``base_model_name_or_path`` is the run's ``hf:`` folder, URI or hub id.

A ``save="trainable"`` checkpoint (LoRA's) holds the trainable part: ``hf`` and ``peft`` load it over the model
built from its folder (the frozen base), ``safetensors`` writes the tensors it holds.

``out`` is a folder, or for ``safetensors`` a path ending in ``.safetensors``: that file, with
``config.json`` beside it. The files are written into a local temporary folder, then moved (local)
or copied (a storage URI) into place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional

import pyarrow.fs as pafs
import safetensors.torch
import torch

from raytrain_mgpu.config.factories import TRUSTED_MODULES_ENV, is_factory, trusted_modules
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing.files import filesystem
from raytrain_mgpu.checkpointing.run_folder import run_uri
from raytrain_mgpu.engine.batches import as_shape
from raytrain_mgpu.engine.weights import SAFETENSORS_FILE, load_weights, pick_checkpoint, read_checkpoint
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.huggingface import hf_source, is_hf, save_tokenizer
from raytrain_mgpu.models.lora import apply_lora

logger = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "export_run", "model_from_meta", "FORMATS", "CONFIG_FILE", "HF_RECORD_FILE"]

FORMATS = ("safetensors", "hf", "peft")
CONFIG_FILE = "config.json"
HF_RECORD_FILE = "raytrain_mgpu.json"
"""The run's record in an ``hf`` export (``config.json`` there is the model's own, Hugging Face's)."""
EXPORT_FORMAT_VERSION = 1


def export_checkpoint(checkpoint_path: str, out: str, fmt: str = "safetensors", model=None) -> List[str]:
    """Write the model of checkpoint ``checkpoint_path`` (a folder or URI) into ``out`` (a path or URI: a folder,
    or for ``safetensors`` a ``.safetensors`` file) as ``fmt``; ``model``: for ``fmt="hf"`` and ``"peft"``,
    the ``transformers.PreTrainedModel`` (LoRA's ``peft.PeftModel``, merged in place for ``hf``) the weights go
    into. Returns the written files' paths (URIs for a storage URI), sorted."""
    out, weights_file = _destination(out, fmt)
    _check_format(fmt, model)
    state, meta = read_checkpoint(checkpoint_path)
    record = _record(meta, checkpoint_path)
    with _output(out or ".") as folder:
        if fmt == "safetensors":
            safetensors.torch.save_file(_writable_tensors(state, checkpoint_path), str(folder / weights_file),
                                        metadata={"format": "pt"})  # what transformers' loaders look for
            (folder / CONFIG_FILE).write_text(json.dumps(record, indent=1) + "\n")
        else:
            _load_trained(model, state, meta, checkpoint_path)
            _save_pretrained(model, folder, fmt, (meta.get("config") or {}).get("model", meta.get("model")))
            (folder / HF_RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    paths = [posixpath.join(out, name) for name in names]
    logger.info("exported %s as %s: %s", redact(checkpoint_path), fmt, ", ".join(redact(p) for p in paths))
    return paths


def export_run(run_path: str, out: Optional[str] = None, fmt: str = "safetensors", best: bool = False,
               model=None, allow_code: bool = False) -> List[str]:
    """:func:`export_checkpoint` of run folder ``run_path``'s newest checkpoint (``best``: its best one) into
    ``out`` (default ``<run>/export``, ``<run>/export-best`` with ``best``). ``fmt="hf"`` without ``model``
    rebuilds the model from the checkpoint's recorded config (:func:`model_from_meta`)."""
    if out is not None:
        _destination(out, fmt)
    if fmt == "safetensors" or model is not None:  # a model to build from the record is checked once built
        _check_format(fmt, model)
    checkpoint = pick_checkpoint(run_path, best)
    if fmt in ("hf", "peft") and model is None:
        model = model_from_meta(checkpoint.meta, checkpoint.uri, allow_code)
    out = out or run_uri(run_path, "export-best" if best else "export")
    return export_checkpoint(checkpoint.uri, out, fmt, model)


def model_from_meta(meta: dict, source: str, allow_code: bool = False):
    """The model a checkpoint's ``meta.json`` records, built again (its weights as initialised).

    Only ``model`` and ``model_kwargs`` of the recorded config are read: the other fields may record
    objects (a dataset or loss passed from Python) that a config cannot be built from and the model does
    not need. A model named ``module:function`` is code named by a file in the run folder, so it is built
    only with ``allow_code`` or a module listed in ``RAYTRAIN_MGPU_TRUSTED_MODULES``, as a config file's."""
    display, config = redact(source), meta.get("config") or {}
    spec = config.get("model", meta.get("model"))
    if isinstance(spec, str) and spec.startswith("<object "):
        raise ValueError(f"checkpoint {display!r} was trained with model={spec}: a Python object, which cannot be "
                         f"rebuilt from the run folder. Export with fmt='safetensors' (CLI: --format safetensors), "
                         f"or build the model in Python and pass it: export_checkpoint(path, out, 'hf', model).")
    if isinstance(spec, str) and is_factory(spec) and not allow_code:
        module = spec.split(":", 1)[0]
        if not any(module == t or module.startswith(t + ".") for t in trusted_modules()):
            raise ValueError(f"checkpoint {display!r} names code to build its model (model={spec!r}), and a run "
                             f"folder that names code is code. If you trust it, pass allow_code=True (CLI: "
                             f"--allow-code) or set {TRUSTED_MODULES_ENV}={module}.")
    cfg = TrainConfig.from_dict({"model": spec, "model_kwargs": config.get("model_kwargs") or {},
                                 "lora": config.get("lora")}, source=f"checkpoint {display!r} (meta.json)")
    model = build_model(cfg.model, as_shape(meta["input_shape"]), meta["num_classes"], cfg.model_kwargs,
                        pretrained=True)  # an hf: model's base weights, from its folder
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)  # the adapters' values come from the checkpoint
    return model


def _destination(out: str, fmt: str):
    """``(folder, weights file name)`` of ``out``: a folder and ``model.safetensors``, or a path ending in
    ``.safetensors`` split into its folder (``""``: the current one) and that name (``safetensors`` only)."""
    if not out.endswith(".safetensors"):
        return out.rstrip("/") or out, SAFETENSORS_FILE
    if fmt == "hf":
        folder = out[:-len(".safetensors")]
        raise ValueError(f"export out={out!r} names a .safetensors file, but fmt='hf' writes a folder (the model's "
                         f"save_pretrained files). Give a folder, e.g. out={folder!r} (CLI: --out {folder}), or use "
                         f"fmt='safetensors' (CLI: --format safetensors) to write that one file.")
    if "://" not in out and os.path.isdir(out):
        raise ValueError(f"export out={out!r} is a folder (an earlier export into it?), and a path ending in "
                         f".safetensors names the file to write. Remove the folder, or give another path.")
    return posixpath.split(out)


def _check_format(fmt: str, model) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"export format fmt={fmt!r} is not one of {', '.join(FORMATS)}.")
    if fmt == "safetensors" and model is not None:
        raise ValueError("fmt='safetensors' writes the checkpoint's own tensors and takes no model; pass model= "
                         "with fmt='hf' or 'peft' only.")
    if fmt == "peft" and model is not None and not _is_peft(model):
        raise ValueError(f"fmt='peft' writes LoRA adapters (peft's adapter folder), but the model is a "
                         f"{type(model).__qualname__} without them: the run trained no TrainConfig.lora. Use "
                         f"fmt='hf' (CLI: --format hf) or 'safetensors' for the whole model.")
    if fmt in ("hf", "peft") and model is not None:
        try:
            from transformers import PreTrainedModel  # late: optional dependency (the lm extra)
        except ImportError:
            raise ValueError(f"fmt={fmt!r} needs transformers (pip install raytrain-mgpu[lm]); or use "
                             f"fmt='safetensors'.") from None
        if not isinstance(model.get_base_model() if _is_peft(model) else model, PreTrainedModel):
            raise ValueError(f"fmt='hf' writes a transformers PreTrainedModel with save_pretrained, but the model is "
                             f"a {type(model).__module__}.{type(model).__qualname__}. Use fmt='safetensors' (CLI: "
                             f"--format safetensors) for any other model.")
    if fmt in ("hf", "peft") and model is None:
        raise ValueError(f"fmt={fmt!r} needs the model: a transformers PreTrainedModel (with LoRA: its PeftModel) "
                         f"built like the trained one (export_run builds it from the run's recorded config).")


def _is_peft(model) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel means peft is loaded
    return peft is not None and isinstance(model, peft.PeftModel)


def _load_trained(model, state: dict, meta: dict, source: str) -> None:
    """The checkpoint's weights into ``model``: all of them, or (``save="trainable"``) the trainable part over the
    base the model was built with; a trainable parameter the checkpoint lacks is an error either way."""
    if (meta.get("config") or {}).get("save") != "trainable":
        load_weights(model, state, strict=True, source=source)
        return
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or trainable & set(missing):
        raise ValueError(f"checkpoint {redact(source)!r} (save='trainable') does not fit the model built from its "
                         f"config: trainable tensors missing {sorted(trainable & set(missing))[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}. Export with the model (and lora settings) it was trained with.")


def _save_pretrained(model, folder: Path, fmt: str, spec) -> None:
    """``fmt="peft"``: the adapters (``base_model_name_or_path``: the run's ``hf:`` source); ``fmt="hf"``: the model
    (LoRA's adapters merged into the base), with the ``hf:`` model's tokenizer beside it."""
    if fmt == "peft":
        if is_hf(spec):  # the user's folder, URI or hub id, not a node's cached copy
            for adapter in model.peft_config.values():
                adapter.base_model_name_or_path = hf_source(spec)
        model.save_pretrained(str(folder))
        return
    if _is_peft(model):
        model = model.merge_and_unload()  # W + (alpha / r) B A, the adapters' modules gone
    model.save_pretrained(str(folder))
    if is_hf(spec):
        save_tokenizer(spec, str(folder))


def _record(meta: dict, checkpoint_path: str) -> dict:
    return {"format": "raytrain-mgpu export", "format_version": EXPORT_FORMAT_VERSION,
            "checkpoint": redact(checkpoint_path),
            **{key: meta.get(key) for key in ("model", "input_shape", "num_classes", "strategy", "epoch", "step")},
            "config": meta.get("config") or {}}


def _writable_tensors(state: dict, source: str) -> dict:
    """``state`` as safetensors takes it: CPU tensors that are contiguous and own their memory. A tensor
    sharing memory with one already taken (tied weights) or a view of a larger one is copied."""
    taken, tensors = set(), {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint {redact(source)!r}: {name!r} is a {type(value).__name__}, not a tensor, "
                             f"and safetensors holds tensors only.")
        tensor = value.detach().cpu()
        storage = tensor.untyped_storage()
        whole = (tensor.is_contiguous() and tensor.storage_offset() == 0
                 and storage.nbytes() == tensor.numel() * tensor.element_size())
        if whole and storage.data_ptr() not in taken:
            taken.add(storage.data_ptr())
        else:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        tensors[name] = tensor
    return tensors


@contextlib.contextmanager
def _output(out: str) -> Iterator[Path]:
    """A local temporary folder whose files end up in ``out``: moved into a local one (the temporary folder
    is made beside it, so a move is a rename), copied into a storage URI."""
    fs, inner = filesystem(out)
    local = isinstance(fs, pafs.LocalFileSystem)
    if local:
        Path(inner).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-export-", dir=str(Path(inner).parent) if local else None) as tmp:
        yield Path(tmp)
        _usual_modes(Path(tmp))
        if local:
            Path(inner).mkdir(parents=True, exist_ok=True)
            for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
                target = Path(inner) / path.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        else:
            fs.create_dir(inner, recursive=True)
            pafs.copy_files(tmp, inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def _usual_modes(folder: Path) -> None:
    """Give every file the mode a new file of this process gets: safetensors (and so ``save_pretrained``)
    writes 0600, which others sharing the storage cannot read."""
    probe = folder / ".mode-probe"
    probe.touch()  # created as 0666 less the umask, which is read without changing it
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(mode)
