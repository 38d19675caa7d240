"""Weights in and out (``engine/weights.py``, ``driver/export.py``, ``raytrain-mgpu export``), on models we
did not write: torchvision's resnet18 exported and loaded under a new head, a tiny Hugging Face BERT exported
with ``save_pretrained`` and read back with ``from_pretrained``; every checkpoint layout this project writes
(one ``model.pt``, pipeline parts, a sharded DCP folder of FSDP2), run folders (newest, best), ``.pt`` files
as other trainers save them, storage URIs, and every error's message. No Ray."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torchvision
from _extras import importorskip
from torch import nn

from raytrain_mgpu.cli import main
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.driver.export import export_checkpoint, export_run
from raytrain_mgpu.engine.weights import load_weights, read_weights, trainable_state

BEST = {"monitor": "test_loss", "mode": "min", "epoch": 1, "value": 0.25}


def _resnet18(num_classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=num_classes)
    with torch.no_grad():  # trained-looking buffers: an export must carry them too
        for name, buffer in model.named_buffers():
            if "running" in name:
                buffer.add_(torch.rand_like(buffer))
    return model


def _write(folder, state=None, *, epoch=1, step=10, part="", model="torchvision.models:resnet18", **meta):
    config = {"model": model, "model_kwargs": {}, "epoch": epoch}
    ckpt_format.write_checkpoint(str(folder), meta={"model": model, "strategy": "ddp", "epoch": epoch, "step": step,
                                                    "input_shape": [3, 32, 32], "num_classes": 10, "config": config,
                                                    **meta},
                                 history=[], model_state=state, part=part)
    return str(folder)


def _same(state: dict, other: dict) -> bool:
    return state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)


# ----------------------------------------------------------------------------- resnet18 out and in


def test_a_resnet18_export_loads_under_a_new_head_with_init_strict_false(tmp_path):
    trained = _resnet18(10, seed=0)
    _write(tmp_path / "run" / "checkpoint_epoch000001", trained.state_dict())
    paths = export_run(str(tmp_path / "run"))
    assert paths == [str(tmp_path / "run" / "export" / "config.json"), str(tmp_path / "run" / "export" /
                                                                           "model.safetensors")]
    record = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert record["input_shape"] == [3, 32, 32] and record["num_classes"] == 10 and record["epoch"] == 1
    assert record["config"]["model"] == "torchvision.models:resnet18"

    state, info = read_weights(paths[1])
    assert info == {"kind": "safetensors", "path": paths[1], "meta": None} and _same(state, trained.state_dict())
    fresh = _resnet18(5, seed=1)
    head = {k: v.clone() for k, v in fresh.state_dict().items() if k.startswith("fc.")}
    report = load_weights(fresh, state, strict=False, source=paths[1])
    assert sorted(report.mismatched) == [("fc.bias", (10,), (5,)), ("fc.weight", (10, 512), (5, 512))]
    assert report.missing == [] and report.unexpected == [] and len(report.loaded) == 120
    assert "loaded 120 of the model's 122 tensors; 2 of another shape left as built" in report.describe()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, head[name] if name.startswith("fc.") else trained.state_dict()[name]), name

    with pytest.raises(ValueError, match=r"model.safetensors' do not fit the model: 2 of another shape \(fc.bias: "
                                         r"checkpoint \[10\], model \[5\], fc.weight: checkpoint \[10, 512\], model "
                                         r"\[5, 512\]\). Load weights of this model, or set init_strict=False to load "
                                         r"the matching keys \(e.g. a new head\)"):
        load_weights(_resnet18(5, seed=1), state, strict=True, source=paths[1])


def test_strict_loading_lists_missing_and_unexpected_keys(tmp_path):
    state = _resnet18(10, seed=0).state_dict()
    del state["layer4.1.bn2.bias"]
    state["extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"'w.pt' do not fit the model: 1 missing from the checkpoint "
                                         r"\(layer4.1.bn2.bias\); 1 not in the model \(extra.weight\)\. "):
        load_weights(_resnet18(10, seed=1), state, strict=True, source="w.pt")
    report = load_weights(_resnet18(10, seed=1), state, strict=False, source="w.pt")
    assert report.missing == ["layer4.1.bn2.bias"] and report.unexpected == ["extra.weight"]
    with pytest.raises(ValueError, match=r"'w.pt': none of their 2 tensors matches the model by name and shape "
                                         r"\(checkpoint: a, b; model: conv1.weight, bn1.weight"):
        load_weights(_resnet18(10, seed=1), {"a": torch.zeros(1), "b": torch.zeros(1)}, strict=False, source="w.pt")


# ----------------------------------------------------------------------------- Hugging Face


def tiny_bert(num_classes):
    """A ``BertForSequenceClassification`` built from a config (no download)."""
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, num_labels=num_classes)
    return transformers.BertForSequenceClassification(config)


def test_a_tiny_bert_exports_as_a_hugging_face_folder(tmp_path, capsys):
    transformers = importorskip("transformers")  # on CI (CI=true) a failure where it is missing
    torch.manual_seed(0)
    trained = tiny_bert(10).state_dict()
    run = tmp_path / "run"
    checkpoint = _write(run / "checkpoint_epoch000001", trained, model="test_weights:tiny_bert")
    torch.manual_seed(1)
    paths = export_checkpoint(checkpoint, str(tmp_path / "hf"), "hf", tiny_bert(10))
    assert {os.path.basename(p) for p in paths} == {"config.json", "model.safetensors", "raytrain_mgpu.json"}
    loaded = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "hf"))
    assert _same(loaded.state_dict(), trained)

    with pytest.raises(ValueError, match=r"names code to build its model \(model='test_weights:tiny_bert'\), and a "
                                         r"run folder that names code is code. If you trust it, pass "
                                         r"allow_code=True \(CLI: --allow-code\)"):
        export_run(str(run), fmt="hf")
    assert main(["export", str(run), "--format", "hf"]) == 2 and "--allow-code" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "hf", "--allow-code"]) == 0
    assert f"{run}/export/model.safetensors" in capsys.readouterr().out
    assert _same(transformers.BertForSequenceClassification.from_pretrained(str(run / "export")).state_dict(),
                 trained)


def test_the_hugging_face_format_refuses_what_it_cannot_write(tmp_path):
    checkpoint = _write(tmp_path / "run" / "checkpoint_epoch000001", _resnet18(10, 0).state_dict())
    with pytest.raises(ValueError, match=r"fmt='hf' writes a transformers PreTrainedModel with save_pretrained, but "
                                         r"the model is a torchvision.models.resnet.ResNet. Use fmt='safetensors'"):
        export_checkpoint(checkpoint, str(tmp_path / "out"), "hf", _resnet18(10, 0))
    with pytest.raises(ValueError, match=r"fmt='hf' needs the model: a transformers PreTrainedModel"):
        export_checkpoint(checkpoint, str(tmp_path / "out"), "hf")
    with pytest.raises(ValueError, match=r"fmt='safetensors' writes the checkpoint's own tensors and takes no model"):
        export_checkpoint(checkpoint, str(tmp_path / "out"), "safetensors", _resnet18(10, 0))
    with pytest.raises(ValueError, match=r"export format fmt='onnx' is not one of safetensors, hf"):
        export_checkpoint(checkpoint, str(tmp_path / "out"), "onnx")
    _write(tmp_path / "objects" / "checkpoint_epoch000001", {"w": torch.zeros(1)},
           model="<object __main__:build sha256:0123456789abcdef>")
    with pytest.raises(ValueError, match=r"was trained with model=<object __main__:build sha256:0123456789abcdef>: a "
                                         r"Python object, which cannot be rebuilt from the run folder. Export with "
                                         r"fmt='safetensors' \(CLI: --format safetensors\)"):
        export_run(str(tmp_path / "objects"), fmt="hf")
    assert not (tmp_path / "out").exists()  # refused before anything is written


# ----------------------------------------------------------------------------- files


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do


def test_safetensors_round_trip_of_tied_strided_and_viewed_tensors(tmp_path):
    model = _Tied()
    fused = torch.randn(6, 4)
    state = {**model.state_dict(), "proj": torch.randn(4, 3).t(), "q": fused[:2], "kv": fused[2:]}
    checkpoint = _write(tmp_path / "checkpoint", state)
    saved = ckpt_format.load_model_state(checkpoint)
    assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # torch.load keeps the tie
    paths = export_checkpoint(checkpoint, str(tmp_path / "out"))
    read, info = read_weights(str(tmp_path / "out"))  # an export folder is a source too
    assert info["kind"] == "safetensors" and _same(read, state)
    fresh = tmp_path / "fresh"
    fresh.touch()
    assert {os.stat(p).st_mode & 0o777 for p in paths} == {fresh.stat().st_mode & 0o777}  # not safetensors' 0600
    loaded = _Tied()
    load_weights(loaded, {k: read[k] for k in ("embed.weight", "head.weight")}, strict=True, source="out")
    assert loaded.head.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)


class _Wrapper(nn.Module):
    """A trainer's module that holds the net as ``self.model`` (Lightning): its own names start with "model."."""

    def __init__(self):
        super().__init__()
        self.model = nn.Linear(3, 2)


@pytest.mark.parametrize("saved, prefix", [
    (lambda s: s, ""),
    (lambda s: {"state_dict": {f"module.{k}": v for k, v in s.items()}}, "module."),
    (lambda s: {"model": {f"_orig_mod.{k}": v for k, v in s.items()}, "epoch": 3, "args": ["lr"]}, "_orig_mod."),
    (lambda s: {f"module._orig_mod.{k}": v for k, v in s.items()}, "module._orig_mod."),
    (lambda s: {f"model.{k}": v for k, v in s.items()}, "model."),
])
def test_pt_files_as_trainers_save_them(tmp_path, saved, prefix):
    model = _resnet18(10, 0)
    path = tmp_path / "weights.pth"
    torch.save(saved(model.state_dict()), path)
    state, info = read_weights(str(path))
    assert info == {"kind": "pt", "path": str(path), "meta": None}
    fresh = _resnet18(10, 1)
    report = load_weights(fresh, state, strict=True, source=str(path))
    assert report.stripped_prefix == prefix and _same(fresh.state_dict(), model.state_dict())


def test_a_models_own_model_prefix_is_kept():
    wrapper = _Wrapper()
    report = load_weights(_Wrapper(), wrapper.state_dict(), strict=True, source="w")
    assert report.stripped_prefix == "" and report.loaded == ["model.weight", "model.bias"]


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_bad_sources_name_the_value_and_the_fix(tmp_path):
    torch.save({"weight": _Planted()}, tmp_path / "planted.pt")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "counters.pt")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00")
    (tmp_path / "weights.h5").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    cases = {
        "planted.pt": r"weights file '.*planted.pt' holds objects other than tensors and plain containers .*; it was "
                      r"refused without running it",
        "counters.pt": r"holds a dict with keys \['epoch', 'lr'\], not a state dict: expected names mapped to tensors, "
                       r"or such a mapping under 'state_dict' or 'model'",
        "cut.safetensors": r"'.*cut.safetensors' is not a readable safetensors file",
        "weights.h5": r"'.*weights.h5' has the unknown extension '.h5': pass a .pt/.pth/.bin file",
        "nothing.pt": r"weights '.*nothing.pt' do not exist. Check the path; pass a .pt/.pth/.bin or .safetensors "
                      r"file, a checkpoint folder \(with meta.json\) or a run folder",
        "empty": r"'.*empty' holds no checkpoint \(no checkpoint\*/meta.json, no model.safetensors\)",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            read_weights(str(tmp_path / name))
    with pytest.raises(ValueError, match=r"best=True picks a run folder's best checkpoint, but '.*counters.pt' is a "
                                         r"file. Pass the run folder"):
        read_weights(str(tmp_path / "counters.pt"), best=True)


# ----------------------------------------------------------------------------- checkpoints and runs


def test_a_checkpoint_folder_and_a_pipelines_parts(tmp_path):
    state = _resnet18(10, 0).state_dict()
    read, info = read_weights(_write(tmp_path / "plain", state, epoch=4))
    assert _same(read, state) and info["kind"] == "checkpoint" and info["meta"]["epoch"] == 4
    names = list(state)
    _write(tmp_path / "pipeline", {k: state[k] for k in names[:50]}, part="-stage0")
    _write(tmp_path / "pipeline", {k: state[k] for k in names[50:]}, part="-stage1")
    assert sorted(os.listdir(tmp_path / "pipeline")) == ["history.json", "meta.json", "model-stage0.pt",
                                                         "model-stage1.pt"]
    read, info = read_weights(f"file://{tmp_path}/pipeline")
    assert _same(read, state) and info["path"] == f"file://{tmp_path}/pipeline"
    with pytest.raises(ValueError, match=r"but '.*plain' is a checkpoint folder. Pass the run folder"):
        read_weights(str(tmp_path / "plain"), best=True)


def test_a_run_folders_newest_and_best_checkpoints(tmp_path, capsys):
    first, second = _resnet18(10, 0).state_dict(), _resnet18(10, 1).state_dict()
    run = tmp_path / "run"
    _write(run / "checkpoint_epoch000001", first, epoch=1, step=10, best=BEST)
    _write(run / "checkpoint_epoch000002", second, epoch=2, step=20, best=BEST)  # worse: epoch 1 stays the best
    read, info = read_weights(str(run))
    assert _same(read, second) and info["kind"] == "run" and info["path"].endswith("checkpoint_epoch000002")
    assert info["run"] == str(run) and info["meta"]["step"] == 20
    read, info = read_weights(str(run), best=True)
    assert _same(read, first) and info["path"].endswith("checkpoint_epoch000001")
    assert export_run(str(run), best=True)[0] == f"{run}/export-best/config.json"
    assert _same(read_weights(f"{run}/export-best/model.safetensors")[0], first)

    no_best = tmp_path / "no_best"
    _write(no_best / "checkpoint_epoch000001", first)
    with pytest.raises(ValueError, match=r"run folder '.*no_best' has no best checkpoint: one is kept when the run "
                                         r"trains with keep_best=True and monitor set"):
        read_weights(str(no_best), best=True)
    assert main(["export", str(no_best), "--best"]) == 2 and "has no best checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"run folder '.*missing' does not exist"):
        export_run(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"'.*checkpoint_epoch000001' is a checkpoint folder, not a run folder: pass "
                                         r"its run folder"):
        export_run(str(run / "checkpoint_epoch000001"))
    assert main(["export", str(run), "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.splitlines() == ["wrote 2 file(s):", f"  {tmp_path}/cli/config.json",
                                                    f"  {tmp_path}/cli/model.safetensors"]


def test_a_sharded_fsdp2_checkpoint_is_consolidated_on_the_driver(tmp_path, gloo_group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)  # DTensor shards, as the fsdp strategy saves
    checkpoint = tmp_path / "run" / "checkpoint_epoch000001"
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(checkpoint / "sharded"))
    _write(checkpoint, None, sharded=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    read, info = read_weights(str(tmp_path / "run"))
    assert info["path"] == str(checkpoint) and _same(read, full)
    export_run(str(tmp_path / "run"))
    plain = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    load_weights(plain, read_weights(f"{tmp_path}/run/export/model.safetensors")[0], strict=True, source="export")
    assert _same(plain.state_dict(), full)


# ----------------------------------------------------------------------------- storage URIs


@pytest.fixture
def fake_storage(tmp_path, monkeypatch):
    """``fake://<path>``: ``tmp_path`` behind a pyarrow filesystem that is not the local one, so every read
    downloads and every write uploads, as on s3:// or gs://."""
    import pyarrow.fs as pafs

    from raytrain_mgpu.driver import export
    from raytrain_mgpu.checkpointing import run_folder
    from raytrain_mgpu.engine import weights

    remote = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())

    def filesystem(path):
        return (remote, path.split("://", 1)[1]) if path.startswith("fake://") else (pafs.LocalFileSystem(), path)

    for module in (ckpt_format, run_folder, weights, export):
        monkeypatch.setattr(module, "filesystem", filesystem)
    return tmp_path


def test_storage_uris_are_downloaded_and_uploaded(fake_storage):
    state = _resnet18(10, 0).state_dict()
    _write(fake_storage / "run" / "checkpoint_epoch000001", state)
    read, info = read_weights("fake://run")
    assert info["path"] == "fake://run/checkpoint_epoch000001" and _same(read, state)
    paths = export_run("fake://run")
    assert paths == ["fake://run/export/config.json", "fake://run/export/model.safetensors"]
    assert (fake_storage / "run" / "export" / "model.safetensors").is_file()
    assert _same(read_weights("fake://run/export/model.safetensors")[0], state)
    torch.save({"state_dict": state}, fake_storage / "w.pt")
    assert _same(read_weights("fake://w.pt")[0], state)


# ----------------------------------------------------------------------------- save="trainable"


def test_trainable_state_keeps_trainable_parameters_and_every_buffer():
    model = _resnet18(10, 0)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    kept = trainable_state(model.state_dict(), model)
    buffers = {name for name, _ in model.named_buffers()}
    assert set(kept) == {"fc.weight", "fc.bias"} | buffers and len(buffers) == 60  # BatchNorm's running stats

    base = _resnet18(10, 1)
    report = load_weights(base, kept, strict=False, source="trainable")  # over the base weights
    assert sorted(report.missing) == sorted(n for n, p in model.named_parameters() if not n.startswith("fc."))
    assert torch.equal(base.fc.weight, model.fc.weight) and torch.equal(base.bn1.running_mean, model.bn1.running_mean)

    tied = _Tied()
    tied.embed.weight.requires_grad_(False)
    assert trainable_state(tied.state_dict(), tied) == {}  # frozen under both of its names
    with pytest.raises(ValueError, match=r"none of the model's parameter names \(e.g. conv1.weight, .*\) is in the "
                                         r"state \(module.conv1.weight, .*pass the state dict of this model, unwrapped"):
        trainable_state({f"module.{k}": v for k, v in model.state_dict().items()}, model)


def test_a_checkpoint_whose_optimizer_state_does_not_fit_the_model_is_refused_naming_init_from(tmp_path):
    """The model's parameters changed since the checkpoint was written (its weights still load, e.g. through a
    load hook): torch's bare error on the optimizer state becomes one that names the way to keep the weights."""
    import raytrain_mgpu as rtm
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    fields = dict(model="mlp", model_kwargs={"widths": [8]}, dataset="digits", num_samples=64, batch_size=32,
                  num_workers=1, use_gpu=False, runner="local", storage_path=str(tmp_path), name="changed")
    rtm.fit(rtm.TrainConfig(**fields, epochs=1))
    checkpoint = RunFolder(str(tmp_path / "changed")).newest_checkpoint().uri
    state = torch.load(os.path.join(checkpoint, "train_state.pt"), weights_only=False)
    state["optimizer"]["param_groups"][0]["params"] = state["optimizer"]["param_groups"][0]["params"][:-1]
    torch.save(state, os.path.join(checkpoint, "train_state.pt"))
    with pytest.raises(ValueError, match=r"its optimizer state does not fit this model's parameters .*Start a new run "
                                         r"\(another `name`\) from its weights: init_from='.*checkpoint_epoch000001'"):
        rtm.fit(rtm.TrainConfig(**fields, epochs=2))
