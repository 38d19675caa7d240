"""Structured batches (``raytrain_mgpu.engine.batches``): dict inputs, dict targets and dict outputs on every strategy.

The model is ``examples.two_inputs``' two-input network (``forward(image, profile) -> {"digit",
"odd"}``) with its two-head loss: each strategy's ``compute_loss`` on dict batches must train it
to the same weights as the plain model on the whole batch (one process, CPU stand-in devices),
and a 2-stage pipeline (local processes, gloo) must match the unsplit model. The Ray runs of
the example are in ``tests/test_examples.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import raytrain_mgpu as rtm
from raytrain_mgpu.engine import batches
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from examples import two_inputs  # noqa: E402

CPU = torch.device("cpu")
OBJECTIVE = Objective("examples.two_inputs:digit_and_parity",
                      ["examples.two_inputs:digit_accuracy", "examples.two_inputs:parity_accuracy"])


def _batches(sizes=(10, 7, 10)):
    data = two_inputs.digit_views(None).train
    out, start = [], 0
    for n in sizes:
        out.append(next(iter(DataLoader(torch.utils.data.Subset(data, range(start, start + n)), batch_size=n))))
        start += n
    return out


# ----------------------------------------------------------------------------- the functions


def test_to_device_call_model_and_counts_follow_the_structure():
    x, y = _batches((6,))[0]
    assert set(x) == {"image", "profile"} and set(y) == {"digit", "odd"}
    moved = batches.to_device(x, CPU, channels_last=True)
    assert moved["image"].is_contiguous(memory_format=torch.channels_last) and moved["profile"].dim() == 2
    assert batches.batch_size(x) == 6 and batches.target_count(y) == 6  # rows, not 12 values
    assert batches.target_count(torch.zeros(6, 5, dtype=torch.long)) == 30  # a tensor target: numel (tokens)
    calls = []
    model = lambda *args, **kwargs: calls.append((len(args), sorted(kwargs)))  # noqa: E731
    batches.call_model(model, x), batches.call_model(model, (1, 2)), batches.call_model(model, torch.zeros(1))
    assert calls == [(0, ["image", "profile"]), (2, []), (1, [])]


def test_split_cuts_every_tensor_like_tensor_split():
    x, y = _batches((10,))[0]
    parts = batches.split(y, 4)
    assert [p["digit"].shape[0] for p in parts] == [t.shape[0] for t in y["digit"].tensor_split(4)] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p["odd"] for p in parts]), y["odd"])
    tensors, spec = batches.flatten(y)
    assert len(tensors) == spec.num_leaves == 2 and batches.unflatten(tensors, spec).keys() == y.keys()
    with pytest.raises(ValueError, match="holds a str where a tensor was expected"):
        batches.flatten({"name": "a"})
    with pytest.raises(ValueError, match="holds no tensor"):
        batches.first_tensor({"name": "a"})


def test_shapes_round_trip_through_json():
    for shape in ((1, 8, 8), {"image": (1, 8, 8), "profile": (16,)}, ((3,), (4, 2))):
        assert batches.as_shape(batches.shape_record(shape)) == shape
    assert batches.shape_record({"profile": (16,)}) == {"profile": [16]}


# ----------------------------------------------------------------------------- every one-process strategy


def _fresh():
    torch.manual_seed(0)
    return two_inputs.two_input_net(10)


def _sgd(model, step, data, unwrap=lambda m: m):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for x, y in data:
        step(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}


@pytest.mark.parametrize("name,devices", [("ddp", 1), ("dp", 2), ("dp_balanced", 3), ("mp", 2), ("ddp2", 2)])
def test_every_strategy_trains_dict_batches_like_the_plain_model(name, devices):
    data = _batches()  # batches of 10 and 7 rows: uneven slices on 2 and 3 devices
    want = _sgd(_fresh(), lambda m, x, y: two_inputs.digit_and_parity(m(**x), y), data)
    cfg = rtm.TrainConfig(model="examples.two_inputs:two_input_net", dataset="examples.two_inputs:digit_views",
                          strategy=name, num_workers=1, gpus_per_worker=devices)
    strategy = build_worker(get_strategy(name), cfg.parallel, WorkerContext(0, 1, 0, 1, 0, (CPU,) * devices), OBJECTIVE)
    model = strategy.setup_model(_fresh())
    got = _sgd(model, lambda m, x, y: strategy.placement.compute_loss(strategy, m, x, y)[0], data,
               unwrap=strategy.unwrap)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    # The meter counts rows of a dict target and adds both metrics' pairs, wherever they were computed.
    meter = EpochMeter(CPU, OBJECTIVE)
    with torch.no_grad():
        for x, y in data:
            loss, outputs = strategy.placement.compute_loss(strategy, model, x, y)
            meter.add(loss, outputs, y)
    loss_sum, samples, totals = meter.split(meter.totals.tolist())
    assert samples == 27 and totals["digit_accuracy"][1] == totals["parity_accuracy"][1] == 27
    plain = strategy.unwrap(model)
    with torch.no_grad():
        correct = sum(int(two_inputs.digit_accuracy(plain(**x), y)[0]) for x, y in data)
    assert totals["digit_accuracy"][0] == correct


# ----------------------------------------------------------------------------- 2-stage pipeline (local processes)

PIPELINE_STEPS = 3


def test_a_two_stage_pipeline_trains_dict_batches_like_the_unsplit_model():
    from _pipeline_local import LocalRun, run_local

    cfg = two_inputs.config("pipeline").replace(lr=0.05, optimizer="sgd", batch_size=16, num_samples=None)
    result, = run_local([LocalRun(cfg, PIPELINE_STEPS)])
    # The unsplit model on the same global batches (the sampler's order), summed the same way.
    data = build_datasets(cfg.data)
    objective = Objective.of(cfg, data.num_classes)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    meter = EpochMeter(CPU, objective)
    for x, y in list(DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler))[:PIPELINE_STEPS]:
        outputs = model(**x)
        loss = objective.loss(outputs, y)
        meter.add(loss.detach(), outputs, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    assert result.model_state.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(result.model_state[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    # The epoch's row (the engine's sums over every rank: the last stage measures them) holds the same
    # loss and both metrics over the same rows of the dict targets.
    row = result.stats[0]["history"][-1]
    loss_sum, samples, totals = meter.split(meter.totals.tolist())
    assert samples == PIPELINE_STEPS * 16 and row["step"] == PIPELINE_STEPS
    assert row["samples_per_s"] * row["training_s"] == pytest.approx(samples)  # rows counted, not 2 values a row
    assert abs(row["train_loss"] - loss_sum / samples) <= 1e-4 * abs(loss_sum / samples)
    for name in ("digit_accuracy", "parity_accuracy"):
        total, count = totals[name]
        assert count == samples and row[f"train_{name}"] == pytest.approx(total / count), name


def test_the_memory_estimate_refuses_structured_inputs_with_the_fix():
    from raytrain_mgpu.planning.memory import profile_model

    with pytest.raises(ValueError, match=r"structured \(input_shape=\{'image'.*Choose strategy and layout yourself"):
        profile_model(two_inputs.two_input_net(10), {"image": (1, 8, 8), "profile": (16,)})
