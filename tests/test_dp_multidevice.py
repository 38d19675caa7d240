"""The multi-device branches of dp, dp_balanced, ddp2, mp and ddp_mp on CPU stand-in devices.

These are the code paths a worker with several GPUs runs (scatter -> replicate ->
parallel_apply -> gather, the model split over devices, DDP over either). Under GPU
emulation every device is the CPU; each test checks that a step equals the plain model's
(loss, predictions, every parameter's gradient) and that the split really happened (k
slices, k replica threads), so a wrapper that silently returned the plain model fails.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import raytrain_mgpu as rtm
from raytrain_mgpu.models import build_model
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.parallel import _dp_ops
from raytrain_mgpu.parallel.placement import SplitModel, StandInDataParallel

CPU = torch.device("cpu")


def _strategy(name: str, devices: int, world_size: int = 1, **overrides):
    cfg = rtm.TrainConfig(strategy=name, num_workers=1, gpus_per_worker=devices, **overrides)
    ctx = WorkerContext(world_rank=0, world_size=world_size, local_rank=0, local_world_size=1, node_rank=0,
                        devices=(CPU,) * devices)
    return build_worker(get_strategy(name), cfg.parallel, ctx)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, (1, 8, 8), 10, {"widths": [32, 16]} if name == "mlp" else {})


def _batch(n: int):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def _plain_step(model, x, y):
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    return loss.detach(), logits.detach().argmax(1), {n: p.grad.clone() for n, p in model.named_parameters()}


def _strategy_step(strategy, model, x, y):
    wrapped = strategy.setup_model(model)
    loss, logits = strategy.placement.compute_loss(strategy, wrapped, x, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in strategy.unwrap(wrapped).named_parameters()}
    return (loss.detach(), logits.detach().argmax(1), grads), wrapped


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-6, msg=key)


class _Calls:
    """Records (thread name, batch size) of every forward of ``module`` and its replicas."""

    def __init__(self, module: nn.Module):
        self.seen = []
        self._lock = threading.Lock()
        # Replicas copy the module's __dict__, hooks included: the hook fires for each replica.
        module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, args):
        with self._lock:
            self.seen.append((threading.current_thread().name, args[0].shape[0]))

    def sizes(self):
        return sorted((n for _, n in self.seen), reverse=True)

    def threads(self):
        return {name for name, _ in self.seen}




# batch 10 on 3 devices: slices 4, 4, 2 (torch's chunk); 7 on 2: 4, 3
@pytest.mark.parametrize("devices,batch,slices", [(2, 7, [4, 3]), (3, 10, [4, 4, 2])])
@pytest.mark.parametrize("model_name", ["mlp", "lenet"])
def test_dp_scatters_over_devices_and_matches_the_plain_model(model_name, devices, batch, slices):
    x, y = _batch(batch)
    want = _plain_step(_model(model_name), x, y)
    model = _model(model_name)
    calls = _Calls(model)
    got, wrapped = _strategy_step(_strategy("dp", devices), model, x, y)
    _assert_same(got, want)
    assert isinstance(wrapped, StandInDataParallel)
    assert calls.sizes() == slices  # one forward per slice, none on the whole batch
    assert len(calls.threads()) == devices and threading.current_thread().name not in calls.threads()


def test_dp_with_one_device_is_the_plain_model_and_evaluates_like_it():
    model = _model("mlp")
    assert _strategy("dp", 1).setup_model(model) is model
    wrapped = _strategy("dp", 3, output_device=2).setup_model(_model("mlp"))
    x, _ = _batch(5)
    with torch.no_grad():
        torch.testing.assert_close(wrapped.eval()(x), _model("mlp").eval()(x))


@pytest.mark.parametrize("devices,batch,slices", [(2, 7, [4, 3]), (3, 10, [4, 4, 2]), (3, 2, [1, 1])])
def test_dp_balanced_runs_one_replica_thread_per_slice(devices, batch, slices):
    x, y = _batch(batch)
    want = _plain_step(_model("lenet"), x, y)
    model = _model("lenet")
    calls = _Calls(model)
    got, _ = _strategy_step(_strategy("dp_balanced", devices), model, x, y)
    _assert_same(got, want)
    assert calls.sizes() == slices and len(calls.threads()) == len(slices)


@pytest.mark.parametrize("devices", [2, 3])
def test_ddp2_is_ddp_over_the_scattering_data_parallel(devices, gloo_group):
    # world_size=2 in the context makes the strategy wrap DDP; the group has one rank, so
    # the all-reduce is the identity and the step must equal the plain model's.
    x, y = _batch(10)
    want = _plain_step(_model("lenet"), x, y)
    model = _model("lenet")
    calls = _Calls(model)
    got, wrapped = _strategy_step(_strategy("ddp2", devices, world_size=2), model, x, y)
    _assert_same(got, want)
    assert isinstance(wrapped, DistributedDataParallel) and isinstance(wrapped.module, StandInDataParallel)
    assert len(calls.sizes()) == devices and sum(calls.sizes()) == 10


@pytest.mark.parametrize("devices,batch", [(2, 7), (3, 10)])
def test_mp_and_ddp_mp_split_the_model_and_match_the_plain_model(devices, batch, gloo_group):
    x, y = _batch(batch)
    want = _plain_step(_model("mlp"), x, y)
    for name, world_size in (("mp", 1), ("ddp_mp", 2)):
        got, wrapped = _strategy_step(_strategy(name, devices, world_size=world_size), _model("mlp"), x, y)
        _assert_same(got, want)
        split = wrapped.module if name == "ddp_mp" else wrapped
        assert isinstance(split, SplitModel)
        # mlp [32, 16]: 6 blocks (Flatten, Linear, ReLU, Linear, ReLU, Linear), every device holds some
        assert sorted(set(split.block_device_indices)) == list(range(devices))
        assert split.block_device_indices == sorted(split.block_device_indices)
    assert isinstance(wrapped, DistributedDataParallel)


def test_batchnorm_running_stats_come_from_the_first_slice_as_on_gpus():
    # torch's DataParallel keeps only device 0's buffer updates; the stand-in replicas clone
    # their buffers, so the same holds and no two threads update one buffer.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8))
    reference = nn.BatchNorm1d(8)
    reference.load_state_dict(net[2].state_dict())
    x, _ = _batch(9)
    wrapped = StandInDataParallel(net, [CPU] * 3, 0)
    wrapped(x)
    with torch.no_grad():
        reference(net[1](x.flatten(1)[:3]))
    torch.testing.assert_close(net[2].running_mean, reference.running_mean)
    assert int(net[2].num_batches_tracked) == 1


def test_replica_threads_keep_the_callers_autocast_dtype_and_grad_mode():
    wrapped = StandInDataParallel(nn.Linear(4, 4), [CPU] * 2, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapped(torch.ones(4, 4)).dtype == torch.bfloat16
    with torch.no_grad():
        assert not wrapped(torch.ones(4, 4)).requires_grad
    assert wrapped(torch.ones(4, 4)).requires_grad


def test_stand_in_scatter_splits_like_torch_and_names_a_failing_replica():
    x = torch.arange(10)
    assert [len(s) for s in _dp_ops.scatter(x, [CPU] * 3)] == [4, 4, 2]
    assert len(_dp_ops.scatter(torch.arange(2), [CPU] * 3)) == 2  # fewer slices than devices
    parts = _dp_ops.scatter({"x": x, "tag": "a"}, [CPU] * 2)
    assert [p["tag"] for p in parts] == ["a", "a"] and torch.equal(parts[1]["x"], torch.arange(5, 10))
    inputs, kwargs = _dp_ops.scatter_kwargs((x,), {"scale": 2}, [CPU] * 2)
    assert len(inputs) == 2 and kwargs == ({"scale": 2}, {"scale": 2})

    def broken(t):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match=r"DataParallel replica 1 \(CPU stand-in device\) failed: ValueError: boom"):
        _dp_ops.parallel_apply([lambda t: t, broken], [(x,), (x,)], devices=[CPU, CPU])


def test_autocast_data_parallel_hands_each_replica_thread_the_callers_bf16(monkeypatch):
    """``AutocastDataParallel.parallel_apply``, the CUDA ``dp`` path, with torch's CUDA-only
    ``parallel_apply`` swapped for plain threads (autocast state is thread-local there too).

    Plain threads drop the caller's autocast (the fp32 control below), so bf16 outputs can
    only come from the override capturing the caller's dtype and re-entering it per thread.
    """
    from raytrain_mgpu.parallel import placement

    seen = {}

    def threads_only(calls, inputs, kwargs, devices):
        seen["devices"] = list(devices)
        results = [None] * len(calls)

        def run(i):
            results[i] = calls[i](*inputs[i], **kwargs[i])

        workers = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return results

    monkeypatch.setattr(placement, "parallel_apply", threads_only)
    wrapper = placement.AutocastDataParallel.__new__(placement.AutocastDataParallel)  # no CUDA here to build it
    nn.Module.__init__(wrapper)
    wrapper.src_device_obj, wrapper.device_ids = CPU, [0, 1]
    replicas = [nn.Linear(4, 3), nn.Linear(4, 3)]
    inputs, kwargs = [(torch.randn(2, 4),), (torch.randn(2, 4),)], [{}, {}]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = wrapper.parallel_apply(replicas, inputs, kwargs)
        control = threads_only(replicas, inputs, kwargs, [0, 1])  # the same threads, no override
    assert [out.dtype for out in outputs] == [torch.bfloat16, torch.bfloat16]
    assert [out.dtype for out in control] == [torch.float32, torch.float32]
    assert seen["devices"] == [0, 1]
