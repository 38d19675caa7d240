"""Hugging Face model folders as ``model="hf:<folder, URI or hub id>"`` (``models/huggingface.py``).

- the checks before Ray: a folder that is not there, is a file, has no ``config.json`` or no weights; a hub id
  with ``HF_HUB_OFFLINE=1`` that is not cached (one that is loads from the hub's cache); a dataset whose vocabulary
  the embeddings do not cover;
- the driver never reads a weight: every check ``fit`` makes before it starts its runner passes on a folder whose
  weights file is garbage, with safetensors' readers made to raise, and the model it checks is on ``meta``;
- a folder in storage (a ``file://`` URI here, as ``s3://`` goes through pyarrow) is copied once into the node's
  cache, and again once it changes;
- the loss a causal LM's ``(batch, seq, vocab)`` logits get is the mean token cross-entropy against the next tokens;
- a full fine-tune (no LoRA) exports as a folder transformers loads with its tokenizer, giving ``load_model``'s logits.
"""

from __future__ import annotations

import os
import shutil
from unittest import mock

import pytest
import torch

import raytrain_mgpu as rtm
from test_lora import VOCAB, _fit, _test_xy, fields, lm, token_blocks  # noqa: F401 - lm: the module's fixture


def _refused(model: str, message: str) -> None:
    """``fit`` refuses ``model`` with ``message`` before it connects to Ray (whether or not Ray is up here)."""
    from raytrain_mgpu import api

    cfg = rtm.TrainConfig(model=model, dataset="synthetic_text", input_shape=[16], num_classes=64, num_samples=64,
                          runner="ray", num_workers=1, use_gpu=False, batch_size=16, storage_path="/tmp/never")
    with mock.patch.object(api, "connect", side_effect=AssertionError("fit connected to Ray before the check")), \
            pytest.raises(ValueError, match=message):
        rtm.fit(cfg)


def test_a_folder_that_is_not_a_model_folder_is_refused_before_ray_naming_the_fix(lm, tmp_path):
    _refused(f"hf:{tmp_path}/missing", r"TrainConfig.model='hf:.*/missing': the folder .*/missing does not exist "
                                       r"\(and is not a hub id of the form org/name\). Check the path; every node")
    (tmp_path / "file").write_text("x")
    _refused(f"hf:{tmp_path}/file", r"is a file, not a Hugging Face model folder. Point at the folder that holds it")
    _refused(f"hf:{tmp_path}", r"has no config.json, so it is not a Hugging Face model folder. Point at the folder "
                               r"save_pretrained wrote")
    shutil.copy(os.path.join(lm.model, "config.json"), tmp_path / "config.json")
    _refused(f"hf:{tmp_path}", r"holds no weights \(model.safetensors, .*\). Save the model with save_pretrained")
    with pytest.raises(ValueError, match=r"TrainConfig.model='hf:': names no Hugging Face folder. Write "
                                         r"model='hf:<folder>'"):
        rtm.TrainConfig(model="hf:")


def test_a_hub_model_not_in_the_cache_is_refused_when_the_hub_is_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refused("hf:raytrain-mgpu-tests/no-such-model",
             r"names the hub model 'raytrain-mgpu-tests/no-such-model', which is not in this machine's hub cache, and "
             r"HF_HUB_OFFLINE=1 forbids downloading it .* unset HF_HUB_OFFLINE, or point at a local folder")


def test_a_hub_id_resolves_through_the_hubs_cache(lm, tmp_path, monkeypatch):
    """``hf:org/name`` is ``huggingface_hub``'s to fetch (``snapshot_download``); offline, from its cache, laid out here
    as the hub lays it out (no network in the tests)."""
    import huggingface_hub.constants
    from safetensors.torch import load_file

    from raytrain_mgpu.models import build_model
    from raytrain_mgpu.models.huggingface import check_source

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--raytrain-mgpu-tests--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(lm.model, repo / "snapshots" / revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no such path here: a hub id
    assert rtm.TrainConfig(model="hf:raytrain-mgpu-tests/tiny-llama").model == "hf:raytrain-mgpu-tests/tiny-llama"
    check_source("hf:raytrain-mgpu-tests/tiny-llama")
    model = build_model("hf:raytrain-mgpu-tests/tiny-llama", (32,), VOCAB, {}, pretrained=True)
    for name, value in load_file(os.path.join(lm.model, "model.safetensors")).items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_dataset_vocabulary_the_embeddings_do_not_cover_is_refused(lm):
    with pytest.raises(ValueError, match=r"its vocabulary holds 512 tokens, but the dataset's has 1000 "
                                         r"\(num_classes\): token ids past 511 have no embedding. Tokenize with "
                                         r"the model's own"):
        rtm.fit(rtm.TrainConfig(model=f"hf:{lm.model}", dataset="synthetic_text", input_shape=[16], num_classes=1000,
                                num_samples=64, runner="ray", num_workers=1, use_gpu=False, batch_size=16,
                                storage_path="/tmp/never"))


def test_a_local_folder_is_made_absolute_the_run_name_is_a_plain_folder_name_and_hf_is_no_code(tmp_path,
                                                                                                  monkeypatch):
    from raytrain_mgpu.config.factories import is_factory

    monkeypatch.chdir(tmp_path)  # the driver's working folder: a Ray worker's is another
    assert rtm.TrainConfig(model="hf:./tiny-llama").model == f"hf:{tmp_path}/tiny-llama"
    assert rtm.TrainConfig(model="hf:org/name").model == "hf:org/name"  # no such path: a hub id
    assert rtm.TrainConfig(model="hf:/models/tiny-llama/", dataset="digits", strategy="ddp").name == \
        "hf.tiny-llama-digits-ddp"
    assert rtm.TrainConfig(model="hf:s3://bucket/llama-3", dataset="digits").name.startswith("hf.llama-3-")
    assert not is_factory("hf:org/name") and is_factory("my_models:build")


class _Reached(Exception):
    """Raised in place of the runner: fit made every check it makes before training."""


def test_the_driver_reads_no_weight_of_an_hf_model_and_checks_it_on_meta(lm, tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch
    import transformers.modeling_utils

    from raytrain_mgpu import api
    from raytrain_mgpu.models import build_model_shapes
    from raytrain_mgpu.strategies import get_strategy

    garbage = tmp_path / "tiny-llama"
    shutil.copytree(lm.model, garbage)
    (garbage / "model.safetensors").write_bytes(b"not weights" * 100)  # any read of it fails
    opened = []

    def refuse(*args, **kwargs):
        opened.append(args[:1])
        raise AssertionError(f"the driver read weights: {args[:1]}")

    for owner, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file"), (safetensors.torch, "load"),
                        (transformers.modeling_utils, "safe_open"), (torch, "load")):
        monkeypatch.setattr(owner, name, refuse)
    monkeypatch.setattr(api, "carrier", lambda runner, plan: (_ for _ in ()).throw(_Reached(runner)))
    cfg = rtm.TrainConfig(**{**fields(lm), "model": f"hf:{garbage}",
                             "dataset": "synthetic_text", "data_root": None, "input_shape": [32],
                             "num_classes": VOCAB, "num_samples": 64, "storage_path": str(tmp_path / "runs")})
    with pytest.raises(_Reached):
        rtm.fit(cfg)  # every check before the runner: the model built and its LoRA targets matched, on meta
    for strategy in ("ddp", "fsdp"):  # the strategies' own checks of the model (a tensor plan's, on meta)
        get_strategy(strategy).check_model(cfg.replace(strategy=strategy, num_workers=2, runner="ray"), (32,), VOCAB)
    model = build_model_shapes(cfg.model, (32,), VOCAB, {})
    assert {p.device.type for p in model.parameters()} == {"meta"} and not opened


def test_a_folder_in_storage_is_copied_once_into_the_nodes_cache_and_again_once_changed(lm, tmp_path, monkeypatch):
    import pyarrow.fs as pafs
    from safetensors.torch import load_file

    from raytrain_mgpu.models import build_model
    from raytrain_mgpu.models.huggingface import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    stored = tmp_path / "bucket" / "tiny-llama"
    shutil.copytree(lm.model, stored)
    copies = []
    copy_files = pafs.copy_files
    monkeypatch.setattr(pafs, "copy_files", lambda *a, **k: (copies.append(a[0]), copy_files(*a, **k))[1])
    uri = f"file://{stored}"
    model = build_model(f"hf:{uri}", (32,), VOCAB, {}, pretrained=True)
    saved = load_file(str(stored / "model.safetensors"))
    for name, value in saved.items():
        assert torch.equal(model.state_dict()[name], value), name
    with torch.device("meta"):
        build_model(f"hf:{uri}", (32,), VOCAB, {}, pretrained=True)  # a meta build: the cached config.json
    build_model(f"hf:{uri}", (32,), VOCAB, {}, pretrained=True)
    assert len(copies) == 1  # the node's copy, reused
    config = stored / "config.json"
    config.write_text(config.read_text().replace('"use_cache": true', '"use_cache": false'))
    build_model(f"hf:{uri}", (32,), VOCAB, {}, pretrained=True)
    assert len(copies) == 2  # the folder changed: copied again
    with pytest.raises(ValueError, match=r"has no config.json, so it is not a Hugging Face model folder"):
        from raytrain_mgpu.models.huggingface import check_source

        check_source(f"hf:file://{tmp_path}/bucket")


def test_a_causal_lms_sequence_logits_get_the_mean_next_token_cross_entropy(lm):
    from transformers import AutoModelForCausalLM

    from raytrain_mgpu.engine.objectives import Objective

    model = AutoModelForCausalLM.from_pretrained(lm.model).eval()
    x, y = (t[:4] for t in _test_xy(lm))
    with torch.no_grad():
        outputs = model(x)
    assert outputs.logits.shape == (4, x.shape[1], VOCAB)
    objective = Objective.of(rtm.TrainConfig(model=f"hf:{lm.model}"), VOCAB)
    want = torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, VOCAB), y.reshape(-1))
    torch.testing.assert_close(objective.loss(outputs, y), want)
    correct, count = objective.measure(outputs, y)[0]  # accuracy: of every next token
    assert count == y.numel() and correct == (outputs.logits.argmax(-1) == y).sum()


def test_a_full_fine_tune_exports_a_folder_transformers_loads_with_its_tokenizer(lm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = _fit(lm, tmp_path / "runs", lora=None, epochs=1, max_steps=4, lr=1e-3, name="full")
    assert result.config.save == "full"
    written = result.export(out=str(tmp_path / "out"), format="hf")
    assert any(p.endswith("tokenizer.json") for p in written)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    x = _test_xy(lm)[0][:2]
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, result.load_model()(x).logits, rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).eos_token == "<|endoftext|>"
