"""Pipeline configs, the transformer_lm model and the text datasets (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets, check_data
from raytrain_mgpu.models import build_model
from raytrain_mgpu.pipeline.plan import choose_partition
from raytrain_mgpu.strategies import get_strategy

TINY_LM = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=32,
               num_samples=64, model_kwargs={"num_layers": 2, "hidden": 16, "num_heads": 2})


def pipeline_cfg(**overrides) -> TrainConfig:
    values = dict(TINY_LM, strategy="pipeline", num_stages=2, num_microbatches=4, batch_size=16, use_gpu=False)
    values.update(overrides)
    return TrainConfig(**values)


def test_bundles_one_per_stage_and_replica():
    assert get_strategy("pipeline").bundles(pipeline_cfg(num_stages=3)) == [{"CPU": 1}] * 3
    ddp = pipeline_cfg(strategy="ddp_pipeline", num_workers=2, num_stages=2, cpus_per_worker=2)
    assert get_strategy("ddp_pipeline").bundles(ddp) == [{"CPU": 2}] * 4
    assert get_strategy("ddp_pipeline").data_parallel_size(ddp) == 2
    assert get_strategy("pipeline").runner == get_strategy("ddp_pipeline").runner == "actor_group"


@pytest.mark.parametrize("overrides,message", [
    (dict(schedule="1f1b", num_stages=4, num_microbatches=2),
     r"num_microbatches=2 is smaller than num_stages=4: schedule='1f1b'.*or use schedule='gpipe'"),
    (dict(batch_size=18), r"batch_size=18 \(global, per step\) does not split into num_microbatches=4 equal "
                          r"micro-batches on each of 1 replica\(s\). Use a multiple of 1 x 4 = 4, e.g. batch_size=16 "
                          r"or 20"),
    (dict(strategy="ddp_pipeline", num_workers=2, batch_size=20),
     r"batch_size=20 \(global, 10 per replica\) does not split into num_microbatches=4 .* on each of 2 replica\(s\). "
     r"Use a multiple of 2 x 4 = 8, e.g. batch_size=16 or 24"),
    (dict(grad_accum_steps=2), r"grad_accum_steps=2: a pipeline already accumulates.*raise num_microbatches"),
    (dict(balance=[1, 1, 1]), r"balance=\[1, 1, 1\] has 3 entries, but num_stages=2 .* splits the model into 2"),
    (dict(schedule="interleaved_1f1b", balance=[2, 2]), r"splits the model into 4 parts"),
])
def test_invalid_pipeline_configs_fail_before_ray(overrides, message):
    with pytest.raises(ValueError, match=message):
        pipeline_cfg(**overrides)


def test_a_storage_uri_is_accepted_like_for_ray_train():
    # The pipeline writes its checkpoints through the run folder's pyarrow filesystem
    # (tests/test_run_folder.py: an object store; tests/test_pipeline_ray.py: a file:// run).
    assert pipeline_cfg(storage_path="s3://bucket/runs").storage_path == "s3://bucket/runs"


def test_more_stages_than_blocks_is_caught_on_the_driver():
    with pytest.raises(ValueError, match=r"num_stages=5 needs 5 parts, more than the 4 blocks model "
                                         r"'transformer_lm' can be split into.*at most 4"):
        choose_partition(pipeline_cfg(num_stages=5, num_microbatches=5, batch_size=20))
    with pytest.raises(ValueError, match=r"num_stages=3 x 2 model chunks per stage \(schedule='interleaved_1f1b'\) "
                                         r"needs 6 parts.*at most 2"):
        choose_partition(pipeline_cfg(num_stages=3, schedule="interleaved_1f1b", num_microbatches=6, batch_size=12))
    with pytest.raises(ValueError, match=r"balance=\[1, 2\] must list 2 positive block counts .* summing to the "
                                         r"model's 4 blocks"):
        choose_partition(pipeline_cfg(balance=[1, 2]))


class Residual(torch.nn.Module):
    """Not a sequence of blocks: its forward adds the input back."""

    def __init__(self, size: int):
        super().__init__()
        self.inner = torch.nn.Linear(size, size)

    def forward(self, x):
        return self.inner(x) + x


def residual_model(input_shape, num_classes):
    return Residual(input_shape[0])


def test_a_model_that_cannot_be_split_says_why():
    cfg = pipeline_cfg(model=f"{__name__}:residual_model", dataset="synthetic", input_shape=[4], num_classes=4,
                       model_kwargs={})
    with pytest.raises(ValueError, match=r"model Residual cannot be split into stages: it is not an nn.Sequential"):
        get_strategy("pipeline").check_model(cfg, (4,), 4)  # what fit() calls before Ray


def test_partition_by_params_on_the_meta_device():
    assert choose_partition(pipeline_cfg()).counts == (2, 2)  # embedding+block | block+head
    assert choose_partition(pipeline_cfg(balance=[1, 3])).counts == (1, 3)


# ----------------------------------------------------------------------------- model and data


def test_transformer_lm_logits_fit_plain_cross_entropy():
    cfg = pipeline_cfg()
    data = build_datasets(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    x, y = data.train[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    torch.testing.assert_close(x[1:], y[:-1])  # next-token targets
    logits = model(x[None])
    assert logits.shape == (1, 32, 8)  # (batch, vocab, seq)
    loss = F.cross_entropy(logits, y[None])
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(32.0)).item()) < 1.0


def test_transformer_lm_is_causal():
    torch.manual_seed(0)
    model = build_model("transformer_lm", (8,), 32, {"num_layers": 2, "hidden": 16, "num_heads": 2})
    x = torch.randint(0, 32, (1, 8))
    changed = x.clone()
    changed[0, 5] = (x[0, 5] + 1) % 32
    torch.testing.assert_close(model(x)[..., :5], model(changed)[..., :5])


def test_synthetic_text_is_deterministic_and_learnable():
    cfg = pipeline_cfg(num_samples=256)
    a, b = build_datasets(cfg.data), build_datasets(cfg.data)
    assert len(a.train) == 256 and len(a.test) == 64
    torch.testing.assert_close(a.train[7][0], b.train[7][0])
    assert check_data(cfg.data) == ((8,), 32)
    # the favoured successor follows a token 3 times in 4: a bigram table learns it
    tokens = torch.stack([a.train[i][0] for i in range(256)])
    pairs = torch.stack([tokens[:, :-1].flatten(), tokens[:, 1:].flatten()], 1)
    counts = torch.zeros(32, 32).index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
    assert counts.max(1).values.sum() / counts.sum() > 0.6


def test_text_file_reads_bytes_in_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 4)
    cfg = TrainConfig(dataset="text_file", data_root=str(path), input_shape=[15], model="transformer_lm",
                      strategy="pipeline", batch_size=4, num_microbatches=2)
    data = build_datasets(cfg.data)
    assert data.num_classes == 256 and data.input_shape == (15,)
    assert len(data.train) + len(data.test) == 1024 // 16 and len(data.test) == 7
    x, y = data.train[1]
    assert x.tolist() == list(range(16, 31)) and y.tolist() == list(range(17, 32))


@pytest.mark.parametrize("values,message", [
    (dict(data_root=None), r"data_root is not set: text_file reads a local text file"),
    (dict(data_root="/no/such/file.txt"), r"data_root='/no/such/file.txt': no such file"),
    (dict(num_classes=100), r"num_classes=100: text_file tokenises bytes, so the vocabulary is 256"),
])
def test_text_file_errors(tmp_path, values, message):
    path = tmp_path / "c.txt"
    path.write_text("hello world " * 100)
    values = {"data_root": str(path), **values}
    cfg = TrainConfig(dataset="text_file", model="transformer_lm", strategy="pipeline", batch_size=4,
                      num_microbatches=2, **values)
    with pytest.raises(ValueError, match=message):
        check_data(cfg.data)
