"""The runnable examples (``examples/``) learn, through the shared test Ray, with fewer epochs.

- ``examples.regression`` (diabetes, ``loss="mse"``, ``metrics=["mae"]``, 2 ddp workers): the
  final test MAE is clearly below predicting the training mean, computed here from the data;
- ``examples.contrastive`` (InfoNCE under ``ddp2``, 2 workers x 2 CPU stand-in devices): the
  test retrieval accuracy is far above chance (1/64) and above the untrained encoder's;
- ``examples.two_inputs`` (dict inputs, dict targets, dict outputs): ddp on 2 workers and a
  2-stage pipeline learn both heads, to the same numbers (the same global batches).

The examples are a local folder, not an installed package: ``fit`` ships it to the workers
(checked here without Ray), and factories given from Python need no ``allow_code``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # as load_factory does for the working folder: never ahead of installed packages

from examples import contrastive, regression, two_inputs  # noqa: E402


def test_the_examples_folder_is_shipped_to_the_workers():
    from raytrain_mgpu.config.factories import local_modules_to_ship

    assert local_modules_to_ship("examples.regression:mlp", "examples.contrastive:info_nce") == [
        str(REPO / "examples")]


def test_the_contrastive_loss_and_metrics_split_the_stacked_views():
    generator = torch.Generator().manual_seed(0)
    views = torch.nn.functional.normalize(torch.randn(8, 1, 4, generator=generator), dim=2)
    matched = torch.cat([views, views], dim=1)  # (N, 2, dim): each second view is its first
    shuffled = torch.cat([views, views.roll(1, dims=0)], dim=1)
    labels = torch.arange(8) % 3
    assert contrastive.info_nce(matched, labels) < contrastive.info_nce(shuffled, labels)
    assert [int(v) for v in contrastive.retrieval_accuracy(matched, labels)] == [8, 8]
    assert int(contrastive.retrieval_accuracy(shuffled, labels)[0]) == 0
    # shuffled: first view i finds second view i+1, the same digit only where labels agree
    assert int(contrastive.same_digit(shuffled, labels)[0]) == int((labels.roll(1) == labels).sum())


def _history(result) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(result.path, "history.parquet")).to_pylist()


def test_the_regression_example_beats_predicting_the_mean(ray_session, storage):
    data = regression.diabetes(None)
    train_y, test_y = data.train.tensors[1], data.test.tensors[1]
    mean_mae = (test_y - train_y.mean()).abs().mean().item()  # about 0.76
    result = regression.main(epochs=4, storage_path=storage)
    history = _history(result)
    assert len(history) == 4 and history[-1]["test_mae"] == result.metrics["test_mae"]
    assert result.metrics["test_mae"] < 0.85 * mean_mae, (result.metrics["test_mae"], mean_mae)
    assert result.metrics["test_accuracy"] is None  # num_classes=None: no accuracy


def test_the_contrastive_example_retrieves_far_above_chance_under_ddp2(ray_session, storage):
    data = contrastive.digit_views(None)
    torch.manual_seed(0)
    untrained = contrastive.encoder((2, 64))
    x, y = torch.stack([data.test[i][0] for i in range(len(data.test))]), data.test.labels
    with torch.no_grad():  # node-sized batches of 64, as the run evaluates
        hits = sum(int(contrastive.retrieval_accuracy(untrained(x[i:i + 64]), y[i:i + 64])[0])
                   for i in range(0, len(x), 64))
    untrained_accuracy = hits / len(x)  # about 0.09
    result = contrastive.main(epochs=4, storage_path=storage)
    history = _history(result)
    assert history[-1]["devices_per_rank"] == [["cpu", "cpu"], ["cpu", "cpu"]]  # 2 workers x 2 stand-in devices
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    accuracy = result.metrics["test_retrieval_accuracy"]
    assert accuracy > 10 / 64 and accuracy > 2 * untrained_accuracy, (accuracy, untrained_accuracy)
    assert result.metrics["test_same_digit"] > 0.3  # chance about 0.1


def test_the_two_input_example_learns_the_same_on_ddp_and_a_pipeline(ray_session, storage):
    ddp = two_inputs.main("ddp", epochs=2, storage_path=storage)
    pipeline = two_inputs.main("pipeline", epochs=2, storage_path=storage)
    for result in (ddp, pipeline):
        history = _history(result)
        assert history[1]["train_loss"] < history[0]["train_loss"]
        assert result.metrics["test_digit_accuracy"] > 0.6 and result.metrics["test_parity_accuracy"] > 0.7  # chance 0.1, 0.5
    for key in ("train_loss", "test_loss", "test_digit_accuracy", "test_parity_accuracy"):
        assert abs(ddp.metrics[key] - pipeline.metrics[key]) <= 1e-3 * abs(ddp.metrics[key]), key
    # The checkpoint keeps the dict of input shapes: the model reloads and predicts as trained.
    x, y = next(iter(torch.utils.data.DataLoader(two_inputs.digit_views(None).test, batch_size=359)))
    with torch.no_grad():
        for result in (ddp, pipeline):
            outputs = result.load_model()(**x)
            correct, count = two_inputs.digit_accuracy(outputs, y)
            assert abs(int(correct) / count - result.metrics["test_digit_accuracy"]) < 1e-9
