"""LoRA on a Hugging Face folder (``model="hf:<folder>"``, ``lora={...}``, peft) and its adapters out.

The model is the tests' tiny Llama saved with ``save_pretrained`` beside its tokenizer (tests/_lm_folders.py); the
data are blocks of its tokenizer's ids over Python's help pages, ``(x, y)`` with ``y`` the next tokens, written once
into a folder that a dataset factory of this module reads (a Ray worker gets this module's file alone):

- in-process LoRA lowers the test loss below the base model's, trains the adapters only (the base weights stay the
  folder's, bit for bit) and its checkpoints hold the adapters and their optimizer state alone;
- a run failing mid-epoch resumes from its step checkpoint (the base rebuilt from the folder, the adapters loaded)
  and ends with the uninterrupted run's weights;
- ``export(format="peft")`` (and the CLI's ``--format peft``) is an adapter folder peft loads onto the base folder,
  giving ``load_model()``'s logits; ``export(format="hf")`` is the merged model with its tokenizer, which
  transformers loads alone, giving the same logits;
- the refusals before Ray, each naming the fix;
- ``fsdp`` over 2 ranks (local gloo processes) writes sharded checkpoints of the adapters alone, resumes from them,
  and ends with the adapters one in-process worker trains; and once through Ray Train's 2 workers.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from types import SimpleNamespace

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data.base import Datasets

if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
    from _extras import require

    require("peft")

SEQ, TRAIN, TEST = 32, 256, 64  # tokens per block; training and test blocks
VOCAB = 512  # _lm_folders.VOCAB: the tokenizer's and the model's
TOKENS_FILE = "blocks.pt"
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}


def token_blocks(cfg):
    """The blocks written by the ``lm`` fixture into ``data_root``: ``(x, y)`` int64 token tensors."""
    blocks = torch.load(os.path.join(cfg.data_root, TOKENS_FILE), weights_only=True)
    pairs = torch.utils.data.TensorDataset(blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous())
    return Datasets(torch.utils.data.Subset(pairs, range(TRAIN)),
                    torch.utils.data.Subset(pairs, range(TRAIN, TRAIN + TEST)), (SEQ,), VOCAB)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """The model folder (tiny Llama and tokenizer) and the data folder of its token blocks."""
    from _lm_folders import english_documents, model_folder
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lm")
    documents = english_documents(1200)
    folder = model_folder(root, documents)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = []
    for document in documents:
        ids += tokenizer(document)["input_ids"] + [tokenizer.eos_token_id]
    count = TRAIN + TEST
    assert len(ids) >= count * (SEQ + 1)
    data = root / "blocks"
    data.mkdir()
    torch.save(torch.tensor(ids[:count * (SEQ + 1)]).view(count, SEQ + 1), data / TOKENS_FILE)
    return SimpleNamespace(model=str(folder), data=str(data))


def fields(lm, **more) -> dict:
    return {"model": f"hf:{lm.model}", "dataset": token_blocks, "data_root": lm.data, "runner": "local",
            "num_workers": 1, "use_gpu": False, "batch_size": 16, "epochs": 2, "optimizer": "adamw", "lr": 1e-2,
            "lora": LORA, **more}


def _fit(lm, storage, **more):
    return rtm.fit(rtm.TrainConfig(**fields(lm, storage_path=str(storage), **more)), stream=io.StringIO())


@pytest.fixture(scope="module")
def trained(lm, tmp_path_factory):
    """One in-process LoRA run of 2 epochs (32 AdamW steps)."""
    return _fit(lm, tmp_path_factory.mktemp("runs"), name="lora")


def _test_xy(lm):
    blocks = torch.load(os.path.join(lm.data, TOKENS_FILE), weights_only=True)[TRAIN:TRAIN + TEST]
    return blocks[:, :-1], blocks[:, 1:]


def _base(lm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lm.model).eval()


def _mean_loss(model, lm) -> float:
    x, y = _test_xy(lm)
    with torch.no_grad():
        logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()


# ----------------------------------------------------------------------------- training


def test_lora_lowers_the_test_loss_and_trains_the_adapters_alone(lm, trained):
    import peft
    from safetensors.torch import load_file

    base_loss = _mean_loss(_base(lm), lm)
    assert trained.metrics["test_loss"] < base_loss - 0.03, (trained.metrics["test_loss"], base_loss)
    model = trained.load_model()
    assert isinstance(model, peft.PeftModel)
    assert _mean_loss(model, lm) == pytest.approx(trained.metrics["test_loss"], rel=1e-5)  # the run's own measure
    saved = load_file(os.path.join(lm.model, "model.safetensors"))
    base = model.get_base_model()
    own = {name.replace(".base_layer", ""): value for name, value in base.state_dict().items() if "lora_" not in name}
    assert set(saved) <= set(own)
    for name, value in saved.items():  # the frozen base: the folder's weights, bit for bit
        assert torch.equal(own[name], value), name
    adapters = {name: p for name, p in model.named_parameters() if "lora_B" in name}
    assert len(adapters) == 2 * 2 and all(p.abs().sum() > 0 for p in adapters.values())  # B starts at 0: learnt


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_alone(trained):
    from raytrain_mgpu.checkpointing.files import load_model_state, load_train_state

    assert trained.config.save == "trainable"  # what lora implies
    state = load_model_state(trained.checkpoint_path)
    assert sorted(state) == sorted(name for name, _ in trained.load_model().named_parameters() if "lora_" in name)
    assert len(state) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    optimizer = load_train_state(trained.checkpoint_path)["optimizer"]
    assert len(optimizer["state"]) == len(state)  # AdamW's moments of the adapters only


def test_a_run_failing_mid_epoch_resumes_from_its_step_checkpoint_and_ends_with_the_uninterrupted_weights(lm, tmp_path):
    """Dropout on the adapters draws from the RNG every step, so the restored generators count in the weights."""
    from raytrain_mgpu.engine import loop as engine

    common = dict(lora={**LORA, "dropout": 0.1}, checkpoint_every_n_steps=5, optimizer="sgd", lr=0.5)
    want = _fit(lm, tmp_path / "straight", **common).load_model().state_dict()
    failed = []

    def fail_once_after_step_22(step):
        if step == 22 and not failed:
            failed.append(step)
            raise RuntimeError("a fault after step 22")

    engine.STEP_EVENTS.append(fail_once_after_step_22)
    try:
        resumed = _fit(lm, tmp_path / "failed", max_failures=1, **common)
    finally:
        engine.STEP_EVENTS.remove(fail_once_after_step_22)
    assert failed == [22] and resumed.history[-1]["attempt"] == 1
    got = resumed.load_model().state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_run_started_again_with_other_lora_settings_is_refused(trained):
    with pytest.raises(ValueError, match=r"holds checkpoints trained with lora=\{'r': 4, .*\}, but this run has "
                                         r"lora=\{'r': 8, .*\}: resuming would mix two runs"):
        rtm.fit(trained.config.replace(lora={**LORA, "r": 8}), stream=io.StringIO())


# ----------------------------------------------------------------------------- adapters out


def test_the_peft_export_loads_onto_the_base_folder_with_peft_and_gives_load_models_logits(lm, trained, tmp_path):
    import peft
    from raytrain_mgpu.cli import main

    out = tmp_path / "adapters"
    written = trained.export(out=str(out), format="peft")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {os.path.basename(p) for p in written}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == lm.model
    x = _test_xy(lm)[0][:4]
    with torch.no_grad():
        want = trained.load_model()(x).logits
        got = peft.PeftModel.from_pretrained(_base(lm), str(out)).eval()(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert main(["export", trained.path, "--format", "peft", "--out", str(tmp_path / "cli")]) == 0
    cli = (tmp_path / "cli" / "adapter_model.safetensors").read_bytes()
    assert cli == (out / "adapter_model.safetensors").read_bytes()


def test_the_merged_hf_export_with_its_tokenizer_loads_with_transformers_and_gives_the_same_logits(lm, trained,
                                                                                                   tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    trained.export(out=str(out), format="hf")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in name for name in merged.state_dict())  # the adapters are in the weights now
    x = _test_xy(lm)[0][:4]
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, trained.load_model()(x).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(x).logits, _base(lm)(x).logits, atol=1e-4)  # not the base's
    text = "Python's help pages, tokenized the same way."
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == AutoTokenizer.from_pretrained(lm.model)(
        text)["input_ids"]


def test_a_peft_export_of_a_run_without_lora_is_refused_naming_the_formats(lm, tmp_path):
    full = _fit(lm, tmp_path, lora=None, epochs=1, max_steps=2, name="full")
    with pytest.raises(ValueError, match=r"fmt='peft' writes LoRA adapters .* the run trained no TrainConfig.lora. "
                                         r"Use fmt='hf' \(CLI: --format hf\) or 'safetensors'"):
        full.export(out=str(tmp_path / "x"), format="peft")


# ----------------------------------------------------------------------------- refusals before Ray


@pytest.mark.parametrize("lora,message", [
    ({**LORA, "r": 0}, r"TrainConfig.lora=.*: r=0 must be a positive integer. Set r to e.g. 8"),
    ({**LORA, "alpha": -1}, r"alpha=-1 must be a positive number. Set alpha to e.g. 16"),
    ({**LORA, "dropout": 1.0}, r"dropout=1.0 must be a number in \[0, 1\)"),
    ({**LORA, "rank": 8}, r"has unknown keys \['rank'\]. Use 'r': the rank"),
    ({**LORA, "target_modules": []}, r"target_modules=\[\] must be a list of module names or 'all-linear'"),
    ([8], r"TrainConfig.lora=\[8\]: must be a mapping of LoRA settings"),
])
def test_bad_lora_settings_are_refused_with_the_fix(lora, message):
    with pytest.raises(ValueError, match=message):
        rtm.TrainConfig(model="hf:/models/any", lora=lora)


def test_lora_needs_a_hugging_face_model_and_peft(monkeypatch):
    with pytest.raises(ValueError, match=r"adapts a Hugging Face model, and model='mlp' is not one. Set "
                                         r"model='hf:<folder>'"):
        rtm.TrainConfig(model="mlp", lora=LORA)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs peft, which is not installed. pip install raytrain-mgpu\[lm\]"):
        rtm.TrainConfig(model="hf:/models/any", lora=LORA)


@pytest.mark.parametrize("more,message", [
    (dict(strategy="pipeline", num_stages=2), r"TrainConfig.lora with strategy='pipeline': LoRA is trained by ddp "
                                              r"and fsdp.* Use strategy='ddp'"),
    (dict(strategy="mp", num_workers=1, gpus_per_worker=2), r"lora with strategy='mp'"),
    (dict(strategy="dp", num_workers=1), r"lora with strategy='dp'"),
    (dict(strategy="fsdp", num_workers=2, tensor_parallel_size=2), r"TrainConfig.lora with tensor_parallel_size=2: "
                                                                   r"a tensor plan splits the base layers.* Set "
                                                                   r"tensor_parallel_size=1"),
])
def test_lora_is_refused_by_the_strategies_that_split_or_copy_the_model(more, message):
    with pytest.raises(ValueError, match=message):
        rtm.TrainConfig(model="hf:/models/any", lora=LORA, use_gpu=False, batch_size=16, **more)


def test_target_modules_that_match_no_module_are_refused_before_training_listing_the_linear_layers(lm, tmp_path):
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] match no module of hf:.*tiny-llama. Name its "
                                         r"linear layers, e.g. of \['down_proj', 'gate_proj', 'k_proj', 'lm_head', "
                                         r"'o_proj', 'q_proj', 'up_proj', 'v_proj'\], or 'all-linear'"):
        _fit(lm, tmp_path, lora={**LORA, "target_modules": ["q_proj", "qkv"]})
    assert not (tmp_path / "lora").exists()  # refused before a run folder


# ----------------------------------------------------------------------------- fsdp


def _fsdp_rank(rank: int, world: int, lm_model: str, lm_data: str, storage: str, epochs: int) -> None:
    from _engine import make_engine

    lm = SimpleNamespace(model=lm_model, data=lm_data)
    run = fields(lm, strategy="fsdp", optimizer="sgd", lr=0.5, epochs=epochs)
    run.pop("runner")  # two ranks: a process each, as Ray Train's workers
    engine = make_engine({**run, "name": "sharded"}, rank=rank, world=world, storage=storage, setup=False)
    engine.run()


def test_fsdp_on_two_ranks_checkpoints_the_adapters_sharded_resumes_and_ends_with_one_workers_adapters(lm, tmp_path):
    """Two local gloo ranks, as two Ray Train workers run the engine: the sharded checkpoint (DCP) holds the adapters
    alone, a second start resumes from it (the base rebuilt from the folder on rank 0 and sent to the shards), and
    the adapters after 2 epochs are one in-process worker's (its ddp twin) to SGD's rounding."""
    import _forkserver
    from _reference import train_one_worker
    from raytrain_mgpu.checkpointing.files import SHARDED_DIR, consolidate_sharded, is_sharded, read_history
    from raytrain_mgpu.checkpointing.run_folder import RunFolder
    from torch.distributed.checkpoint import FileSystemReader

    storage = str(tmp_path / "runs")
    _forkserver.start_gloo_ranks(_fsdp_rank, (lm.model, lm.data, storage, 1))
    first = RunFolder(os.path.join(storage, "sharded")).newest_checkpoint()
    assert is_sharded(first.path)
    saved = FileSystemReader(os.path.join(first.path, SHARDED_DIR)).read_metadata().state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert len(model_keys) == 8 and all("lora_" in key for key in model_keys)  # no base weight in the shards
    _forkserver.start_gloo_ranks(_fsdp_rank, (lm.model, lm.data, storage, 2))
    last = RunFolder(os.path.join(storage, "sharded")).newest_checkpoint()
    history = read_history(last.path)
    assert [row["epoch"] for row in history] == [1, 2]
    assert history[0] == read_history(first.path)[0]  # epoch 1 as the first start trained it: resumed, not retrained
    adapters = consolidate_sharded(last.path, "model")
    want, _, _, _ = train_one_worker(fields(lm, strategy="fsdp", optimizer="sgd", lr=0.5, epochs=2))
    assert sorted(adapters) == sorted(k for k in want if "lora_" in k)
    for key, value in adapters.items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.ray
def test_fsdp_with_lora_on_two_ray_train_workers_ends_with_one_in_process_workers_adapters(lm, ray_session, storage,
                                                                                            monkeypatch):
    """The workers, on 2 emulated GPUs, load the base from the folder (the driver reads no weight: safetensors'
    readers raise in this process while fit runs), shard it, train the adapters; the gathered adapters are one
    worker's (SGD, 32 steps)."""
    import safetensors
    import safetensors.torch
    import transformers.modeling_utils
    from _emulation_checks import check_devices
    from _reference import train_one_worker

    run = fields(lm, strategy="fsdp", optimizer="sgd", lr=0.5)

    def refuse(*args, **kwargs):
        raise AssertionError(f"the driver read weights: {args[:1]}")

    for owner, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file"),
                        (transformers.modeling_utils, "safe_open")):
        monkeypatch.setattr(owner, name, refuse)
    # on the shared instance's emulated GPUs: the GPU path (devices, NCCL's semantics) with CPU arithmetic
    result = rtm.fit(rtm.TrainConfig(**{**run, "runner": "ray", "num_workers": 2, "use_gpu": True,
                                        "name": "lora-fsdp", "storage_path": storage}))
    monkeypatch.undo()
    assert result.history[-1]["workers"] == 2
    check_devices(result.history[-1], workers=2, per_worker=1)
    got = result.load_model().state_dict()
    want, _, _, history = train_one_worker(run)
    assert got.keys() == want.keys()
    for key, value in want.items():  # the adapters trained; the base, the folder's on both sides
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert [row["train_loss"] for row in result.history] == pytest.approx([row["train_loss"] for row in history],
                                                                          rel=1e-4)


def test_lora_on_text_from_the_models_own_tokenizer_lowers_the_test_loss_and_reports_perplexity(lm, tmp_path):
    # End to end as a user brings it: the model folder (its tokenizer beside it), Parquet of English text, LoRA.
    import math

    from _lm_folders import english_documents, save_text

    text = save_text(tmp_path / "text", english_documents(600), files=2)
    result = rtm.fit(rtm.TrainConfig(model=f"hf:{lm.model}", dataset="text", data_root=str(text), seq_len=SEQ,
                                     lora=LORA, runner="local", num_workers=1, use_gpu=False, batch_size=16,
                                     epochs=2, optimizer="adamw", lr=1e-2, storage_path=str(tmp_path / "runs")),
                     stream=io.StringIO())
    first, last = result.history
    assert last["test_loss"] < first["test_loss"]
    assert last["perplexity"] == pytest.approx(math.exp(last["test_loss"]), rel=1e-6)
    assert last["tokens_per_s"] > 0
