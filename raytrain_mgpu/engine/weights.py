"""Weights in: reading a model's state from a file, a checkpoint or a run, and loading what fits.

:func:`read_weights` takes whatever a user points ``init_from`` at and returns the plain model's
state dict (CPU tensors, keys in the unsplit model's namespace):

- a ``.pt`` / ``.pth`` / ``.bin`` file: a state dict, or a dict holding one under ``"state_dict"``
  or ``"model"`` (torchvision's reference scripts, Lightning); read with ``weights_only=True``, so a
  planted file is refused, never run;
- a ``.safetensors`` file, or a folder holding ``model.safetensors`` (an export of this project,
  a Hugging Face ``save_pretrained`` folder of one file);
- a checkpoint folder of this project (``meta.json``): every strategy's layout, pipeline parts
  merged and a sharded (DCP) one consolidated here, without a process group;
- a run folder ``{storage_path}/{name}``: its newest checkpoint, or the best one.

Each may be a local path, ``file://`` or any URI pyarrow opens. :func:`load_weights` loads a state
into a model built as usual; :func:`trainable_state` is what ``save="trainable"`` keeps.
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

import pyarrow.fs as pafs
import safetensors.torch
import torch
from torch import nn

from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.checkpointing.files import META_FILE, filesystem, load_model_state, local_checkpoint, read_meta
from raytrain_mgpu.checkpointing.run_folder import CheckpointInfo, RunFolder

logger = logging.getLogger(__name__)

__all__ = ["read_weights", "load_weights", "LoadReport", "trainable_state", "pick_checkpoint", "SAFETENSORS_FILE"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_FILE = "model.safetensors"
# Wrappers that put a prefix before every name of a saved state dict: DDP/DataParallel ("module."),
# torch.compile ("_orig_mod."), Lightning modules and other trainers holding the net as ``self.model``.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
_SOURCES = ("a .pt/.pth/.bin or .safetensors file, a checkpoint folder (with meta.json) or a run folder "
            "({storage_path}/{name})")
_SHOWN = 5  # names listed in a message before "and N more"


def read_weights(source: str, best: bool = False) -> Tuple[dict, dict]:
    """``(state dict, info)`` of ``source``; info: ``kind`` ("pt", "safetensors", "checkpoint" or "run"),
    ``path`` (the file or checkpoint folder read: a local path or URI), ``meta`` (the checkpoint's
    ``meta.json``, or None). ``best``: a run folder's best checkpoint instead of its newest."""
    display = redact(source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"weights source {display!r} is not a path: pass {_SOURCES}.")
    fs, inner = filesystem(source)
    kind = fs.get_file_info(inner).type
    if kind == pafs.FileType.NotFound:
        raise ValueError(f"weights {display!r} do not exist. Check the path; pass {_SOURCES}.")
    if kind == pafs.FileType.File:
        _refuse_best(best, display, "a file")
        return _read_file(fs, inner, source), {"kind": _file_kind(source), "path": source, "meta": None}
    if fs.get_file_info(f"{inner.rstrip('/')}/{META_FILE}").type == pafs.FileType.File:
        _refuse_best(best, display, "a checkpoint folder")
        state, meta = read_checkpoint(source)
        return state, {"kind": "checkpoint", "path": source, "meta": meta}
    exported = f"{source.rstrip('/')}/{SAFETENSORS_FILE}"
    if fs.get_file_info(f"{inner.rstrip('/')}/{SAFETENSORS_FILE}").type == pafs.FileType.File:
        _refuse_best(best, display, "an exported folder")
        return _read_file(fs, f"{inner.rstrip('/')}/{SAFETENSORS_FILE}", exported), {
            "kind": "safetensors", "path": exported, "meta": None}
    checkpoint = pick_checkpoint(source, best)
    state, meta = read_checkpoint(checkpoint.uri)
    return state, {"kind": "run", "path": checkpoint.uri, "meta": meta, "run": source}


def pick_checkpoint(run: str, best: bool = False) -> CheckpointInfo:
    """The newest (``best``: the best) complete checkpoint of run folder ``run``; errors say what is missing."""
    display = redact(run)
    folder = RunFolder(run)
    if folder.fs.get_file_info(folder.path).type != pafs.FileType.Directory:
        raise ValueError(f"run folder {display!r} does not exist. Check the path ({{storage_path}}/{{name}}).")
    if folder.read_json(folder.join(META_FILE)) is not None:
        raise ValueError(f"{display!r} is a checkpoint folder, not a run folder: pass its run folder (the folder "
                         f"above it), or the checkpoint itself to export_checkpoint / init_from.")
    newest = folder.newest_checkpoint()
    if newest is None:
        raise ValueError(f"{display!r} holds no checkpoint (no checkpoint*/{META_FILE}, no {SAFETENSORS_FILE}): "
                         f"pass {_SOURCES}.")
    checkpoint = folder.best_checkpoint() if best else newest
    if checkpoint is None:
        raise ValueError(f"run folder {display!r} has no best checkpoint: one is kept when the run trains with "
                         f"keep_best=True and monitor set. Use its newest checkpoint (best=False, no --best).")
    return checkpoint


def read_checkpoint(path: str) -> Tuple[dict, dict]:
    """``(the unsplit model's state, meta.json)`` of one checkpoint folder, local or remote (downloaded)."""
    with local_checkpoint(path) as directory:
        return load_model_state(directory), read_meta(directory)


def _refuse_best(best: bool, display: str, what: str) -> None:
    if best:
        raise ValueError(f"best=True picks a run folder's best checkpoint, but {display!r} is {what}. Pass the "
                         f"run folder ({{storage_path}}/{{name}}), or drop best.")


def _file_kind(source: str) -> str:
    suffix = Path(source.split("?", 1)[0]).suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "pt"
    raise ValueError(f"weights file {redact(source)!r} has the unknown extension {suffix or '(none)'!r}: pass a "
                     f"{'/'.join(TORCH_SUFFIXES)} file (torch.save of a state dict) or a .safetensors file.")


def _read_file(fs, inner: str, source: str) -> dict:
    kind, display = _file_kind(source), redact(source)
    local = inner if isinstance(fs, pafs.LocalFileSystem) else None
    if local is None:  # remote: one file, read into memory (the state dict ends up there anyway)
        with fs.open_input_stream(inner) as stream:
            data = stream.read()
    if kind == "safetensors":
        try:
            return safetensors.torch.load_file(local) if local else safetensors.torch.load(data)
        except Exception as exc:  # noqa: BLE001 - SafetensorError, or a header that is not JSON
            raise ValueError(f"weights file {display!r} is not a readable safetensors file ({exc}); it may be cut "
                             f"short. Export it again.") from None
    try:
        loaded = torch.load(local or io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise ValueError(f"weights file {display!r} holds objects other than tensors and plain containers "
                         f"({first[0] if first else type(exc).__name__}); it was refused without running it. Save "
                         f"model.state_dict() with torch.save, or export it as .safetensors.") from None
    except (EOFError, RuntimeError) as exc:
        raise ValueError(f"weights file {display!r} cannot be read ({type(exc).__name__}: {exc}); it may be cut "
                         f"short.") from None
    return _state_dict_in(loaded, display)


def _is_state_dict(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def _state_dict_in(loaded, display: str) -> dict:
    """A state dict itself, or the one under "state_dict" or "model" of a training checkpoint."""
    if _is_state_dict(loaded):
        return dict(loaded)
    for key in ("state_dict", "model"):
        if isinstance(loaded, dict) and _is_state_dict(loaded.get(key)):
            return dict(loaded[key])
    found = (f"a dict with keys {sorted(map(str, loaded))[:_SHOWN]}" if isinstance(loaded, dict)
             else f"a {type(loaded).__name__}")
    raise ValueError(f"weights file {display!r} holds {found}, not a state dict: expected names mapped to tensors, "
                     f"or such a mapping under 'state_dict' or 'model'. Save model.state_dict().")


# ----------------------------------------------------------------------------- loading


def _listed(names: list) -> str:
    shown = ", ".join(str(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _mismatch_text(mismatched: list) -> str:
    return _listed([f"{name}: checkpoint {list(saved)}, model {list(own)}" for name, saved, own in mismatched])


class LoadReport(NamedTuple):
    """What :func:`load_weights` did: names loaded, the model's names the checkpoint lacks (left as built),
    the checkpoint's names the model lacks (ignored), and ``(name, checkpoint shape, model shape)`` of the
    names in both with other shapes (left as built)."""

    loaded: List[str]
    missing: List[str]
    unexpected: List[str]
    mismatched: List[Tuple[str, tuple, tuple]]
    stripped_prefix: str = ""
    """The wrapper prefix taken off every checkpoint name (e.g. ``"module."``) to make them match, or ""."""

    def describe(self) -> str:
        total = len(self.loaded) + len(self.missing) + len(self.mismatched)
        parts = [f"loaded {len(self.loaded)} of the model's {total} tensors"]
        if self.stripped_prefix:
            parts[0] += f" (checkpoint names read without the prefix {self.stripped_prefix!r})"
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} of another shape left as built ({_mismatch_text(self.mismatched)})")
        if self.missing:
            parts.append(f"{len(self.missing)} not in the checkpoint left as built ({_listed(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} checkpoint tensors the model does not have ignored "
                         f"({_listed(self.unexpected)})")
        return "; ".join(parts) + "."


def _shape(value) -> Optional[tuple]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _strip_wrapper_prefix(state: dict, own: dict) -> Tuple[dict, str]:
    """``state`` with the wrapper prefix (or two: ``"module._orig_mod."``) taken off that makes the most names
    match ``own``, only when no name matches as it is; otherwise ``state`` unchanged."""
    if not state or any(name in own for name in state):
        return state, ""
    best, best_hits = "", 0
    for first in _WRAPPER_PREFIXES:
        for second in ("", *_WRAPPER_PREFIXES):
            prefix = first + second
            hits = sum(1 for name in state if name.startswith(prefix) and name[len(prefix):] in own)
            if hits > best_hits:
                best, best_hits = prefix, hits
    if not best:
        return state, ""
    return {(name[len(best):] if name.startswith(best) else name): v for name, v in state.items()}, best


def load_weights(model: nn.Module, state: dict, strict: bool, source: str) -> LoadReport:
    """Load ``state`` into ``model`` (the model as built, before it is wrapped or sharded); ``source`` names
    the weights in messages.

    ``strict``: every name and shape must match, or a ValueError lists what does not. Otherwise every
    tensor whose name and shape match is loaded and the rest of the model is left as built (e.g. a new
    head); a state of which nothing matches is still an error (another model's weights)."""
    display = redact(source)
    own = model.state_dict()
    state, prefix = _strip_wrapper_prefix(state, own)
    loaded, mismatched = [], []
    for name, value in state.items():
        if name in own:
            if _shape(value) == _shape(own[name]):
                loaded.append(name)
            else:
                mismatched.append((name, _shape(value), _shape(own[name])))
    missing = [name for name in own if name not in state]
    unexpected = [name for name in state if name not in own]
    report = LoadReport(loaded, missing, unexpected, mismatched, prefix)
    if strict and (missing or unexpected or mismatched):
        problems = [f"{len(missing)} missing from the checkpoint ({_listed(missing)})" if missing else "",
                    f"{len(unexpected)} not in the model ({_listed(unexpected)})" if unexpected else "",
                    f"{len(mismatched)} of another shape ({_mismatch_text(mismatched)})" if mismatched else ""]
        raise ValueError(f"weights {display!r} do not fit the model: {'; '.join(p for p in problems if p)}. Load "
                         f"weights of this model, or set init_strict=False to load the matching keys (e.g. a new "
                         f"head) and keep the rest as built.")
    if not loaded and state and own:
        raise ValueError(f"weights {display!r}: none of their {len(state)} tensors matches the model by name and "
                         f"shape (checkpoint: {_listed(list(state))}; model: {_listed(list(own))}); they are another "
                         f"model's. Build the model they were saved from, or point at its weights.")
    model.load_state_dict({name: state[name] for name in loaded}, strict=strict)
    logger.info("weights %s: %s", display, report.describe())
    return report


def trainable_state(model_state: dict, model: nn.Module) -> dict:
    """``model_state`` without the entries of ``model``'s frozen parameters (``requires_grad=False``).

    Kept: the trainable parameters and every buffer, since buffers change in training too (BatchNorm's
    running statistics), and any extra state. This is an adapter-style save: load it with
    ``load_weights(..., strict=False)`` over the base weights, which supply the frozen part.
    ``model_state`` is in the namespace of ``model.state_dict()`` (the unwrapped model's)."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied parameter under each of its names
    if params and model_state and not any(name in model_state for name in params):
        raise ValueError(f"trainable_state: none of the model's parameter names (e.g. {_listed(list(params))}) is "
                         f"in the state ({_listed(list(model_state))}): pass the state dict of this model, "
                         f"unwrapped.")
    return {name: value for name, value in model_state.items()
            if name not in params or params[name].requires_grad}
