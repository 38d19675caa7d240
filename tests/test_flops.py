"""FLOPs of a training step, the devices' peaks and MFU (raytrain_mgpu/engine/flops.py); no GPU, no Ray.

The counts are FlopCounterMode's (2 FLOPs a multiply-add, matrix products and convolutions only), so
they can be checked exactly against the layer shapes; the peaks are looked up by a device name that the
tests put in ``torch.cuda.get_device_name``'s place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_mgpu.engine import flops
from raytrain_mgpu.engine.devices import EMULATE_ENV
from raytrain_mgpu.engine.flops import mfu, peak_flops_per_s, step_flops


def test_linear_layers_count_two_flops_a_multiply_add_forward_and_four_backward():
    batch, a, b, c = 5, 8, 16, 4
    model = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))
    count = step_flops(model, torch.randn(batch, a), torch.randint(0, c, (batch,)), F.cross_entropy)
    # The second layer: forward 2x, backward 4x (its input's gradient and its weight's) = 6 * batch * b * c.
    # The first layer's input needs no gradient, so autograd computes only its weight's: 4 * batch * a * b.
    assert count == 6 * batch * b * c + 4 * batch * a * b


def test_an_input_that_needs_a_gradient_makes_a_single_linear_six_times_batch_in_out():
    batch, n_in, n_out = 3, 7, 5
    x = torch.randn(batch, n_in, requires_grad=True)
    assert step_flops(nn.Linear(n_in, n_out), x, torch.randn(batch, n_out), F.mse_loss) == 6 * batch * n_in * n_out
    assert x.grad is None  # counted on a meta copy of the input


def test_structured_inputs_a_dict_is_passed_as_keyword_arguments():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.image, self.tabular = nn.Linear(6, 3), nn.Linear(2, 3)

        def forward(self, image, tabular):
            return self.image(image) + self.tabular(tabular)

    x = {"image": torch.randn(4, 6), "tabular": torch.randn(4, 2)}
    count = step_flops(TwoInputs(), x, (torch.randint(0, 3, (4,)),), lambda out, y: F.cross_entropy(out, y[0]))
    assert count == 4 * 4 * 6 * 3 + 4 * 4 * 2 * 3


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def _state(model: nn.Module) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "grad_ids": [id(p.grad) for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()],
            "rng": torch.get_rng_state(), "modes": [m.training for m in model.modules()]}


def _same(before: dict, after: dict) -> None:
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before["grads"], after["grads"]))
    assert before["grad_ids"] == after["grad_ids"]  # the very tensors the optimizer holds, not copies
    assert all(torch.equal(a, b) for a, b in zip(before["buffers"], after["buffers"]))
    assert torch.equal(before["rng"], after["rng"]) and before["modes"] == after["modes"]


@pytest.mark.parametrize("where", ["meta", "device"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_counting_changes_no_parameter_gradient_buffer_random_stream_or_mode(monkeypatch, where, mode):
    if where == "device":  # the fallback for a model that cannot run on meta
        def no_meta(*args):
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")

        monkeypatch.setattr(flops, "_count_on_meta", no_meta)
    torch.manual_seed(0)
    model = _BatchNormNet()
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y).backward()  # gradients from a step in progress (accumulation)
    model.train(mode == "train")
    before = _state(model)
    count = step_flops(model, x, y, F.cross_entropy)
    _same(before, _state(model))
    conv = 2 * 4 * 8 * 3 * 9 * 36  # batch, out and in channels, 3x3 kernel, 6x6 outputs
    fc = 2 * 4 * 288 * 10
    assert count == 2 * conv + 3 * fc  # the conv's input needs no gradient: forward + weight gradient


def test_a_model_that_reads_values_in_forward_is_counted_on_its_device_and_left_as_it_was():
    class ReadsAValue(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * (1.0 if x.abs().max().item() < 1e9 else 0.0)  # no value on meta

    model, x, y = ReadsAValue(), torch.randn(3, 4), torch.randn(3, 4)
    before = _state(model)
    assert step_flops(model, x, y, F.mse_loss) == 4 * 3 * 4 * 4
    _same(before, _state(model))


def test_wrappers_are_unwrapped_and_a_sharded_model_is_refused():
    model = nn.Linear(4, 2)
    assert step_flops(nn.DataParallel(model), torch.randn(3, 4), torch.randn(3, 2), F.mse_loss) == 4 * 3 * 4 * 2

    class DTensor(nn.Parameter):  # stands in for torch.distributed.tensor.DTensor: only its name is read
        pass

    model.weight = DTensor(model.weight.detach())
    with pytest.raises(ValueError, match="DTensors .* Count the model before it is sharded"):
        step_flops(model, torch.randn(3, 4), torch.randn(3, 2), F.mse_loss)


def test_torchvision_resnet18_at_cifar_size_matches_torchvisions_published_count_scaled():
    import torchvision

    # torchvision publishes ResNet-18's forward at 3x224x224, 1,000 classes: 1.814 G multiply-adds
    # ("GFLOPS" in its tables), 3.63 GFLOPs. At 32x32 every feature map is 7x smaller a side (224 / 32;
    # 112 -> 16, 56 -> 8, ... 7 -> 1), so the convolutions cost 1/49 of it; the classifier does not scale
    # (512 x 1,000 there, 512 x 10 here).
    published_macs = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.meta["_ops"] * 1e9
    forward = 2 * ((published_macs - 512 * 1000) / 49 + 512 * 10)
    first_conv = 2 * 64 * 3 * 7 * 7 * 16 * 16  # its input needs no gradient: backward is 2x forward there
    expected = 3 * forward - first_conv
    model = torchvision.models.resnet18(num_classes=10)
    batch = 4
    count = step_flops(model, torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)), F.cross_entropy)
    assert count / batch == pytest.approx(expected, rel=0.005)  # 0.217 GFLOPs an image; 1.814 is rounded


# ----------------------------------------------------------------------------- peaks


@pytest.fixture
def gpu_named(monkeypatch):
    """``torch.cuda`` answers as a machine with one GPU of the given name would."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def name(value: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: value)

    return name


T = 1e12


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.5 * T),
    ("NVIDIA H100 80GB HBM3", "32", 67 * T),
    ("NVIDIA H100 PCIe", "bf16-mixed", 756.5 * T),
    ("NVIDIA H100 NVL", "16-mixed", 835.5 * T),
    ("NVIDIA H200", "bf16-mixed", 989.5 * T),
    ("NVIDIA H200 NVL", "bf16-mixed", 835.5 * T),
    ("NVIDIA GH200 480GB", "bf16-mixed", 989.5 * T),
    ("NVIDIA H20", "bf16-mixed", 148 * T),
    ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312 * T),
    ("NVIDIA A100-PCIE-40GB", "32", 19.5 * T),
    ("NVIDIA A100 80GB PCIe", "16-mixed", 312 * T),
    ("NVIDIA A10G", "bf16-mixed", 70 * T),
    ("NVIDIA A10", "bf16-mixed", 125 * T),
    ("NVIDIA L4", "bf16-mixed", 121 * T),
    ("NVIDIA L40S", "bf16-mixed", 362.05 * T),
    ("Tesla V100-SXM2-16GB", "16-mixed", 125 * T),
    ("Tesla V100-PCIE-32GB", "16-mixed", 112 * T),
    ("Tesla V100-SXM2-16GB", "bf16-mixed", None),  # no BF16 unit: autocast emulates it
    ("Tesla T4", "16-mixed", 65 * T),
    ("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.2 * T),
    ("NVIDIA GeForce RTX 3090", "bf16-mixed", 71 * T),
    ("NVIDIA GeForce RTX 3090 Ti", "bf16-mixed", None),  # not in the table: a faster card than the 3090
    ("NVIDIA B200", "bf16-mixed", 2250 * T),
    ("NVIDIA GB200", "bf16-mixed", 2500 * T),
    ("NVIDIA RTX A6000", "bf16-mixed", None),
])
def test_peaks_are_looked_up_by_the_device_name(gpu_named, name, precision, peak):
    gpu_named(name)
    assert peak_flops_per_s(torch.device("cuda", 0), precision) == (pytest.approx(peak) if peak else None)


def test_fp32_is_the_tf32_peak_when_matrix_products_use_tf32(gpu_named):
    gpu_named("NVIDIA H200")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 matrix products
        assert peak_flops_per_s(torch.device("cuda"), "32") == pytest.approx(494.5 * T)
        gpu_named("Tesla T4")  # no TF32 unit: the setting changes nothing there
        assert peak_flops_per_s(torch.device("cuda"), "32") == pytest.approx(8.1 * T)
    finally:
        torch.set_float32_matmul_precision(before)
    gpu_named("NVIDIA H200")
    assert peak_flops_per_s(torch.device("cuda"), "32") == pytest.approx(67 * T)


def test_no_peak_on_a_cpu_or_under_gpu_emulation(gpu_named, monkeypatch):
    gpu_named("NVIDIA H200")
    assert peak_flops_per_s(torch.device("cpu"), "bf16-mixed") is None
    monkeypatch.setenv(EMULATE_ENV, "2")  # the compute device is the CPU, whatever the device says
    assert peak_flops_per_s(torch.device("cuda", 0), "bf16-mixed") is None


def test_an_unknown_precision_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"precision='bf16' is not one of 32, 16-mixed, bf16-mixed"):
        peak_flops_per_s(torch.device("cpu"), "bf16")


def test_mfu_is_achieved_flops_over_the_devices_peak():
    # 100 steps of 1 TFLOP each in 2 s on 2 devices of 100 TFLOP/s: 50 TFLOP/s of 200
    assert mfu(1e12, 100, 2.0, 100e12, 2) == pytest.approx(0.25)
    assert mfu(1e12, 100, 2.0, None, 2) is None
    assert mfu(1e12, 100, 0.0, 100e12, 1) is None


def test_the_device_count_of_a_model_with_syncbatchnorm_in_a_process_group_is_refused(monkeypatch):
    import torch.distributed as dist

    def no_meta(*args):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    monkeypatch.setattr(flops, "_count_on_meta", no_meta)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # as on a rank of two
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match="SyncBatchNorm layers would all-reduce on this rank alone"):
        step_flops(model, torch.randn(2, 3, 5, 5), torch.randn(2, 4, 3, 3), F.mse_loss)
