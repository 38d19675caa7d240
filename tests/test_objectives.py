"""Your own loss and metrics (issue 14): the same weights and exact epoch metrics on every strategy.

A regression task defined here (``test_objectives:regression_data``, ``num_classes`` None
unless the config gives one; ``test_objectives:regressor``, a 1-unit head) trains with a
user loss (``squared_error``) and metrics (``mae`` and the user's ``within_half``):

- 1 vs 2 data-parallel workers (2 local processes, gloo, the engine every worker runs):
  the same weights after an epoch of SGD, and the same epoch metrics, which equal sum/count
  computed by hand over the test split (11 + 10 samples on the two ranks: a mean of the
  ranks' means would differ);
- ``dp_balanced`` on 3 CPU stand-in devices vs the plain model;
- a 2-stage pipeline (the local harness, real stage code) vs the unsplit model, the last
  stage's metric sums included;
- an InfoNCE loss (in-batch negatives) under ``ddp2`` with 2 devices per worker equals one
  process computing it on each node's whole batch, and differs from the per-device loss;
- through Ray: a user metric's ``train_<metric>``/``test_<metric>`` in ``result.metrics`` and in
  ``history.parquet`` (tests/test_ray_ingest.py's fit), a regression without accuracy
  (tests/test_examples.py's regression example).

Factories are named ``test_objectives:<name>``: importable on the driver, in the spawned
processes and on the shared test Ray's workers.
"""

from __future__ import annotations

import collections
import io
import math
import traceback

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import raytrain_mgpu as rtm
from raytrain_mgpu.data import Datasets, build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.engine.objectives import LOSSES, METRICS, Objective, Predictions
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.transports.placement import free_address
from raytrain_mgpu.driver.progress import ProgressPrinter
from raytrain_mgpu.engine.run_state import EPOCH_KEYS, RunState, epoch_row
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

CPU = torch.device("cpu")
FEATURES = 6

# ----------------------------------------------------------------------------- the user's code


def regression_data(cfg) -> Datasets:
    """y = x . w + noise; 64 training and 21 test samples (``num_samples`` overrides the 64)."""
    generator = torch.Generator().manual_seed(7)
    n_train, n_test = cfg.num_samples or 64, 21
    x = torch.randn(n_train + n_test, FEATURES, generator=generator)
    y = x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(n_train + n_test, generator=generator)
    train, test = TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])
    return Datasets(train, test, (FEATURES,), cfg.num_classes)  # num_classes: None unless the config sets one


def regressor(input_shape):
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, 1))


def embedder(input_shape):
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, 4))


def squared_error(outputs, targets):
    return ((outputs.squeeze(1) - targets) ** 2).mean()


def within_half(outputs, targets):
    return ((outputs.squeeze(1) - targets).abs() < 0.5).sum(), targets.numel()


def info_nce(outputs, targets):
    """Contrastive: sample i's positive is its own target embedding, the batch's others are negatives."""
    keys = F.normalize(torch.stack([targets, targets.roll(1), -targets, targets ** 2], dim=1), dim=1)
    logits = F.normalize(outputs, dim=1) @ keys.T / 0.5
    return F.cross_entropy(logits, torch.arange(len(outputs), device=outputs.device))


REGRESSION = dict(model="test_objectives:regressor", dataset="test_objectives:regression_data", strategy="ddp",
                  loss="test_objectives:squared_error", metrics=["mae", "test_objectives:within_half"],
                  optimizer="sgd", lr=0.05, momentum=0.5, batch_size=16, epochs=1, seed=3, cpus_per_worker=1,
                  use_gpu=False)

# ----------------------------------------------------------------------------- registry and config (no Ray)


def test_registries_match_the_config_and_the_default_is_cross_entropy_and_accuracy():
    import typing

    from raytrain_mgpu.config.sections import Loss, Metric

    assert set(typing.get_args(Loss)) == set(LOSSES)
    assert set(typing.get_args(Metric)) == set(METRICS) == {"accuracy", "top5", "mae", "mse"}
    default = Objective()
    assert default.names == ("accuracy",) and default.loss_spec == "cross_entropy"
    cfg = rtm.TrainConfig(**REGRESSION)
    assert Objective.of(cfg, None).names == ("mae", "within_half")
    plain = rtm.TrainConfig(loss="mse")
    assert Objective.of(plain, 10).names == ("accuracy",) and Objective.of(plain, None).names == ()


def test_bad_loss_and_metrics_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"TrainConfig.loss='huber': is not one of \['cross_entropy', 'mse', 'l1', "
                                         r"'bce_with_logits', 'smooth_l1'\] or a 'package.module:function'"):
        rtm.TrainConfig(loss="huber")
    with pytest.raises(ValueError, match=r"TrainConfig.metrics='mae': must be a list .* Write a list, e.g. "
                                         r"metrics=\['mae'\]"):
        rtm.TrainConfig(metrics="mae")
    with pytest.raises(ValueError, match=r"entry 'f1' is not one of \['accuracy', 'top5', 'mae', 'mse'\]"):
        rtm.TrainConfig(metrics=["f1"])
    with pytest.raises(ValueError, match=r"two entries would both be reported as train_mae/test_mae"):
        rtm.TrainConfig(metrics=["mae", "my_metrics:mae"])
    with pytest.raises(ValueError, match=r"would be reported as train_loss/test_loss"):
        rtm.TrainConfig(metrics=["my_metrics:loss"])
    with pytest.raises(ValueError, match=r"TrainConfig.metrics='os:system': 'os' is a standard-library module"):
        rtm.TrainConfig(metrics=["os:system"])
    with pytest.raises(ValueError, match=r"TrainConfig.loss='subprocess:run': 'subprocess' is a standard-library"):
        rtm.TrainConfig(loss="subprocess:run")


def test_a_config_file_names_a_loss_or_metric_function_only_when_allowed(tmp_path):
    for text in ("loss: test_objectives:squared_error\n", "metrics: [mae, test_objectives:within_half]\n"):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=r"names code to run"):
            rtm.TrainConfig.from_yaml(path)
        assert rtm.TrainConfig.from_yaml(path, allow_code=True).to_dict()[text.split(":")[0]]


def test_a_loss_that_returns_no_scalar_and_a_metric_that_returns_no_pair_are_named():
    objective = Objective("test_objectives:within_half", ["test_objectives:squared_error"])
    out, y = torch.randn(4, 1), torch.randn(4)
    with pytest.raises(ValueError, match=r"TrainConfig.loss='test_objectives:within_half' returned tuple, not a "
                                         r"scalar tensor"):
        objective.loss(out, y)
    with pytest.raises(ValueError, match=r"entry 'test_objectives:squared_error' returned Tensor, not a \(sum, count\)"):
        objective.measure(out, y)


class ZooOutput(dict):
    """What a Hugging Face model returns (``ModelOutput``: a dict whose keys are also attributes)."""

    __getattr__ = dict.__getitem__


Named = collections.namedtuple("Named", "loss logits")  # a model zoo's outputs as a named tuple


def test_built_in_losses_and_metrics_read_a_model_zoos_logits_and_user_ones_get_the_outputs():
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    objective = Objective("cross_entropy", ["accuracy", "top5"])
    plain_loss, plain_pairs = objective.loss(logits, y), objective.measure(logits, y)
    for outputs in ({"logits": logits, "hidden": logits * 0}, ZooOutput(logits=logits), Named(None, logits)):
        assert torch.equal(objective.loss(outputs, y), plain_loss), type(outputs)
        assert [(int(a), b) for a, b in objective.measure(outputs, y)] == [(int(a), b) for a, b in plain_pairs]
    with pytest.raises(ValueError, match=r"returned a tuple with no 'logits' tensor.*'module:function'"):
        objective.loss((logits, logits), y)
    # A user's loss and metric get the outputs as the model returned them.
    LOGITS_SEEN.clear()
    mine = Objective("test_objectives:logits_loss", ["test_objectives:logits_metric"])
    outputs = ZooOutput(logits=logits)
    assert torch.equal(mine.loss(outputs, y), plain_loss)
    mine.measure(outputs, y)
    assert LOGITS_SEEN == [ZooOutput, ZooOutput]


LOGITS_SEEN: list = []


def logits_loss(outputs, targets):
    LOGITS_SEEN.append(type(outputs))
    return F.cross_entropy(outputs.logits, targets)


def logits_metric(outputs, targets):
    LOGITS_SEEN.append(type(outputs))
    return (outputs.logits.argmax(1) == targets).sum(), targets.numel()


def test_a_fit_step_and_the_meter_take_a_model_returning_logits_in_a_dict():
    """One strategy step (compute_loss) and the epoch meter on a model that returns ``{"logits": ...}``:
    the loss, gradients and accuracy of the same model returning the tensor."""
    torch.manual_seed(0)
    base = nn.Linear(3, 4)
    wrapped = nn.Module()
    wrapped.inner = base
    wrapped.forward = lambda x: {"logits": base(x)}
    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,))
    strategy = _strategy("ddp", 1, Objective())
    loss_dict, outputs = strategy.placement.compute_loss(strategy, wrapped, x, y)
    loss_dict.backward()
    grads = [p.grad.clone() for p in base.parameters()]
    base.zero_grad()
    loss_plain, plain_outputs = strategy.placement.compute_loss(strategy, base, x, y)
    loss_plain.backward()
    assert torch.equal(loss_dict, loss_plain)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, base.parameters()))
    meter, plain_meter = EpochMeter(CPU, Objective()), EpochMeter(CPU, Objective())
    meter.add(loss_dict, outputs, y)
    plain_meter.add(loss_plain, plain_outputs, y)
    assert torch.equal(meter.totals, plain_meter.totals)


def test_regression_losses_view_the_targets_in_the_outputs_shape():
    out, y = torch.randn(5, 1), torch.randn(5)
    # torch's mse_loss would broadcast (5, 1) against (5,) to (5, 5)
    assert torch.allclose(LOSSES["mse"](out, y), ((out.squeeze(1) - y) ** 2).mean())
    assert torch.allclose(LOSSES["l1"](out, y), (out.squeeze(1) - y).abs().mean())


def host_numbers(outputs, targets):
    """A metric whose sum and count are Python numbers (kept on the host by the meter)."""
    return 0.5 * len(targets), len(targets)


def test_built_in_metrics_and_host_number_pairs():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    targets = torch.tensor([1, 2, 0])
    assert [int(v) for v in METRICS["accuracy"](logits, targets)] == [1, 3]
    assert [int(v) for v in METRICS["top5"](logits, targets)] == [3, 3]  # 3 classes: top-5 is all of them
    lm = torch.randn(2, 7, 4)  # (batch, vocabulary, tokens): the class dimension is 1, as cross_entropy's
    total, count = METRICS["accuracy"](lm, lm.argmax(dim=1))
    assert (int(total), count) == (8, 8)
    assert torch.allclose(LOSSES["bce_with_logits"](torch.zeros(4, 1), torch.ones(4)), torch.tensor(math.log(2)))
    meter = EpochMeter(CPU, Objective("mse", ["test_objectives:host_numbers", "mse"]))
    for out, y in _batches():
        meter.add(torch.tensor(1.0), out, y)
    _, samples, totals = meter.split(meter.totals.tolist())
    assert totals["host_numbers"] == (7.5, 15.0) and totals["mse"][1] == samples == 15


def test_epoch_values_are_sum_over_count_by_hand_and_the_meter_never_syncs():
    from test_host_sync import HostSyncDetector

    objective = Objective("test_objectives:squared_error", ["mae", "test_objectives:within_half"])
    meter = EpochMeter(CPU, objective)
    batches = _batches()
    detector = HostSyncDetector()
    with detector:
        for out, y in batches:
            meter.add(objective.loss(out, y), out, y)
    assert detector.found == []
    loss_sum, samples, totals = meter.split(meter.totals.tolist())
    outputs, targets = torch.cat([o for o, _ in batches]).squeeze(1), torch.cat([y for _, y in batches])
    assert samples == 15 and totals["mae"][1] == 15 and totals["within_half"][1] == 15
    assert math.isclose(totals["mae"][0] / 15, (outputs - targets).abs().double().mean().item(), rel_tol=1e-6)
    assert totals["within_half"][0] == ((outputs - targets).abs() < 0.5).sum().item()
    # the loss: each batch's mean weighted by its size, i.e. the mean over all 15 samples
    assert math.isclose(loss_sum / samples, ((outputs - targets) ** 2).mean().item(), rel_tol=1e-6)
    row = epoch_row(epoch=0, state=RunState(step=3), lr=0.1, loss_sum=loss_sum, samples=samples, elapsed_s=1.0,
                    steps=3, data_wait_share=0.0, peak_memory_bytes=[1], devices={}, metric_totals=totals)
    assert list(row)[:12] == list(EPOCH_KEYS)[:12] and row["train_accuracy"] is None  # regression: no accuracy
    assert row["train_mae"] == totals["mae"][0] / 15 and row["test_mae"] is None and "test_within_half" in row


def test_the_progress_line_shows_every_metric():
    import io

    stream = io.StringIO()
    row = {"epoch": 1, "step": 4, "train_loss": 0.5, "train_accuracy": None, "train_mae": 0.25,
           "train_within_half": 0.75, "test_loss": 0.6, "test_accuracy": None, "test_mae": 0.3,
           "test_within_half": None, "samples_per_s": 100.0}
    ProgressPrinter(2, stream, live=False).epoch(row)
    line = stream.getvalue()
    assert "loss 0.5000  mae 0.2500  within_half 0.7500  test_loss 0.6000  test_mae 0.3000  test_within_half -" in line
    assert "acc" not in line


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 1, generator=generator), torch.randn(n, generator=generator)) for n in (5, 3, 7)]


# ----------------------------------------------------------------------------- dp_balanced and ddp2 (one process)


def _strategy(name: str, devices: int, objective: Objective, world_size: int = 1):
    cfg = rtm.TrainConfig(**{**REGRESSION, "strategy": name, "num_workers": 1, "gpus_per_worker": devices})
    ctx = WorkerContext(0, world_size, 0, 1, 0, (CPU,) * devices)
    return build_worker(get_strategy(name), cfg.parallel, ctx, objective)


def _sgd_steps(model, step, batches, lr=0.05, unwrap=lambda m: m):
    """SGD over ``batches``; ``step(model, x, y)`` returns the loss. The final weights (of ``unwrap(model)``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for x, y in batches:
        step(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}


def _regression_batches(steps: int = 3, n: int = 10):
    x, y = regression_data(rtm.TrainConfig(**REGRESSION).data).train.tensors
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(steps)]


def _fresh(factory=regressor):
    torch.manual_seed(0)
    return factory((FEATURES,))


def _assert_same_weights(got, want, what):
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def test_dp_balanced_trains_a_user_loss_like_the_plain_model_and_adds_the_metric_sums():
    objective = Objective("test_objectives:squared_error", ["mae", "test_objectives:within_half"])
    batches = _regression_batches()
    want = _sgd_steps(_fresh(), lambda m, x, y: squared_error(m(x), y), batches)
    strategy = _strategy("dp_balanced", 3, objective)
    model = strategy.setup_model(_fresh())
    got = _sgd_steps(model, lambda m, x, y: strategy.placement.compute_loss(strategy, m, x, y)[0], batches)
    _assert_same_weights(got, want, "dp_balanced")
    # Only the pairs cross devices (10 targets on 3 devices: 4, 4, 2); they add up to the whole batch's.
    x, y = batches[0]
    _, predictions = strategy.placement.compute_loss(strategy, model, x, y)
    assert isinstance(predictions, Predictions)
    whole = objective.measure(model(x), y)
    for (got_sum, got_count), (want_sum, want_count) in zip(predictions.pairs, whole):
        torch.testing.assert_close(torch.as_tensor(got_sum).double(), torch.as_tensor(want_sum).double())
        assert got_count == want_count == 10


def test_ddp2_computes_info_nce_on_the_nodes_whole_batch():
    objective = Objective("test_objectives:info_nce", [])
    batches = _regression_batches(n=8)
    want = _sgd_steps(_fresh(embedder), lambda m, x, y: info_nce(m(x), y), batches)
    strategy = _strategy("ddp2", 2, objective)
    model = strategy.setup_model(_fresh(embedder))
    got = _sgd_steps(model, lambda m, x, y: strategy.placement.compute_loss(strategy, m, x, y)[0], batches,
                     unwrap=strategy.unwrap)
    _assert_same_weights(got, want, "ddp2")
    assert type(model).__name__ == "StandInDataParallel"  # the node's 2 devices each ran a slice
    # The loss needs the whole batch: per device (dp_balanced's rule) it is another loss.
    per_device = _strategy("dp_balanced", 2, objective)
    x, y = batches[0]
    per_device_loss = per_device.placement.compute_loss(per_device, per_device.setup_model(_fresh(embedder)), x, y)[0]
    assert not torch.allclose(per_device_loss, info_nce(_fresh(embedder)(x), y))


# ----------------------------------------------------------------------------- 1 vs 2 workers (2 local processes)

INFO_NCE = dict(REGRESSION, model="test_objectives:embedder", loss="test_objectives:info_nce", metrics=[],
                strategy="ddp2", gpus_per_worker=2)


def _run_loop(rank: int, world: int, fields: dict):
    """One epoch and one evaluation of the engine every Ray Train worker runs (``engine/loop.py``, with the
    data-parallel step runner), without Ray (tests/_engine.py): ``(row, weights)``."""
    from _engine import make_engine

    threads = torch.get_num_threads()  # make_engine sets cpus_per_worker's, as a worker does
    try:
        engine = make_engine(fields, rank=rank, world=world)
        row = engine.train_epoch(0)
        row.update(engine.evaluate("test"))
        return row, engine.steps.model_state()
    finally:
        torch.set_num_threads(threads)


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            out = {"ddp": _run_loop(rank, world, REGRESSION), "ddp2": _run_loop(rank, world, INFO_NCE)}
            # As bytes: a tensor put on the queue travels as a file descriptor that this process owns,
            # and it may have exited before the parent unpickles it (CI: "Connection reset by peer").
            buffer = io.BytesIO()
            torch.save(out, buffer)
            queue.put((rank, buffer.getvalue(), None))
        finally:
            dist.destroy_process_group()
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


@pytest.fixture(scope="module")
def two_workers():
    """Rank 0's rows and weights of the ddp (regression) and ddp2 (InfoNCE) runs on 2 processes."""
    import _forkserver  # here: Ray's workers import this module by name (its factories), without tests/ helpers

    queue = _forkserver.context().Queue()
    port = free_address()[1]
    processes = [_forkserver.process(_rank_main, (rank, 2, port, queue), daemon=True) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        results = dict((rank, (out, error)) for rank, out, error in (queue.get(timeout=300) for _ in processes))
    finally:
        for process in processes:
            process.join(timeout=30)
    errors = [error for _, error in results.values() if error]
    assert not errors, "\n".join(errors)
    return torch.load(io.BytesIO(results[0][0]))


def test_a_user_loss_and_metrics_train_the_same_on_1_and_2_workers(two_workers):
    (row, weights), (row_one, weights_one) = two_workers["ddp"], _run_loop(0, 1, REGRESSION)
    _assert_same_weights(weights, weights_one, "2 workers vs 1")
    for key in ("train_loss", "train_mae", "train_within_half", "test_loss", "test_mae", "test_within_half"):
        assert math.isclose(row[key], row_one[key], rel_tol=1e-5), key
    assert row["train_accuracy"] is None and row["test_accuracy"] is None  # num_classes=None: no accuracy
    # Exact over ranks: the test split's 21 samples are 11 + 10 on the two ranks; by hand over all 21.
    model = regressor((FEATURES,))
    model.load_state_dict(weights)
    x, y = regression_data(rtm.TrainConfig(**REGRESSION).data).test.tensors
    with torch.no_grad():
        error = model(x).squeeze(1) - y
    assert math.isclose(row["test_mae"], error.abs().double().mean().item(), rel_tol=1e-6)
    assert row["test_within_half"] == (error.abs() < 0.5).sum().item() / 21
    assert math.isclose(row["test_loss"], (error ** 2).double().mean().item(), rel_tol=1e-5)


def test_info_nce_under_ddp2_on_2_workers_is_the_loss_of_each_nodes_batch(two_workers):
    _, weights = two_workers["ddp2"]
    # One process: each step, InfoNCE on each node's batch (the worker's sampler shard), averaged.
    cfg = rtm.TrainConfig(**INFO_NCE, num_workers=2)
    data = build_datasets(cfg.data)
    loaders = [DataLoader(data.train, batch_size=8, drop_last=True,
                          sampler=DistributedSampler(data.train, 2, rank, shuffle=True, seed=cfg.seed, drop_last=True))
               for rank in range(2)]
    for loader in loaders:
        loader.sampler.set_epoch(0)
    torch.manual_seed(cfg.seed)
    model = embedder((FEATURES,))
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    for (x0, y0), (x1, y1) in zip(*loaders):
        ((info_nce(model(x0), y0) + info_nce(model(x1), y1)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    _assert_same_weights(weights, model.state_dict(), "ddp2 on 2 workers vs the node batches")
    # ... and not the loss of the global batch at once (what one worker of 2 devices computes)
    _, whole_batch = _run_loop(0, 1, INFO_NCE)
    assert any(not torch.allclose(weights[k], whole_batch[k], rtol=1e-4, atol=1e-5) for k in weights)


# ----------------------------------------------------------------------------- 2-stage pipeline (local harness)

PIPELINE_STEPS = 5  # 4 steps per epoch (64 samples, batch 16): the last epoch runs 1


def _pipeline_config() -> rtm.TrainConfig:
    return rtm.TrainConfig(**{**REGRESSION, "strategy": "pipeline", "num_stages": 2, "num_microbatches": 4,
                              "num_workers": 1})


def _pipeline_reference(cfg, steps: int):
    """The unsplit model on the global batches; the metric sums of the last epoch's steps."""
    data = build_datasets(cfg.data)
    objective = Objective.of(cfg, data.num_classes)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        meter = EpochMeter(CPU, objective)
        for x, y in list(loader)[: steps - done]:
            out = model(x)
            loss = objective.loss(out, y)
            meter.add(loss, out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
        epoch += 1
    return model.state_dict(), meter.split(meter.totals.tolist())


def test_a_two_stage_pipeline_trains_a_user_loss_like_the_unsplit_model():
    from _pipeline_local import LocalRun, run_local

    cfg = _pipeline_config()
    result, = run_local([LocalRun(cfg, PIPELINE_STEPS)])
    want, (loss_sum, samples, totals) = _pipeline_reference(cfg, PIPELINE_STEPS)
    _assert_same_weights(result.model_state, want, "pipeline vs unsplit")
    # The last epoch's row: the engine's sums over every rank (the last stage measures them), the user's metrics
    row = result.stats[0]["history"][-1]
    assert (row["epoch"], row["step"]) == (2, PIPELINE_STEPS) and samples == 16
    assert row["samples_per_s"] * row["training_s"] == pytest.approx(samples)
    assert math.isclose(row["train_loss"], loss_sum / samples, rel_tol=1e-5)
    assert {k for k in row if k.startswith("train_")} - {"train_loss", "train_accuracy"} == {
        "train_mae", "train_within_half"} and row["train_accuracy"] is None
    for name, (total, count) in totals.items():
        assert count == 16
        assert math.isclose(row[f"train_{name}"], total / count, rel_tol=1e-5, abs_tol=1e-9), name
