"""Parameter groups (``optim.param_groups``) and ``build_optimizer`` over them: the no-decay rule on
torchvision's resnet18, a function naming parameters with a lower LR for the backbone, a frozen
backbone left out of the optimizer, FSDP2's DTensor parameters, and every error's message."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.engine.optim import build_optimizer, build_scheduler, param_groups


def _names(model: nn.Module, group: dict) -> set:
    name_of = {id(p): name for name, p in model.named_parameters()}
    return {name_of[id(p)] for p in group["params"]}


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def backbone_and_head(model: nn.Module) -> list:
    """A ``param_groups`` function as a user writes one: the backbone by name at a tenth of the LR, the head."""
    backbone = [name for name, _ in model.named_parameters() if not name.startswith("fc.")]
    return [{"params": backbone, "lr": 0.001}, {"params": model.fc.parameters()}]


# ----------------------------------------------------------------------------- the rules


def test_no_decay_norm_bias_decays_convolution_and_linear_weights_only():
    model = _resnet18()
    decay, no_decay = param_groups(model, "no_decay_norm_bias", weight_decay=0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    norms = {f"{m}.{p}" for m, module in model.named_modules() if isinstance(module, nn.BatchNorm2d)
             for p in ("weight", "bias")}
    assert len(norms) == 40 and norms <= _names(model, no_decay)  # every bn weight and bias
    assert _names(model, no_decay) == norms | {"fc.bias"}
    assert _names(model, decay) == {name for name, p in model.named_parameters() if p.dim() >= 2}
    assert all("conv" in n or "downsample.0" in n or n == "fc.weight" for n in _names(model, decay))

    optimizer = build_optimizer(param_groups(model, "no_decay_norm_bias", 0.05),
                                TrainConfig(optimizer="sgd", weight_decay=0.05).optim)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]


class _ScaleNorm(nn.Module):
    """A normalisation layer of the model's own with a 2-D weight (the rule finds norms by name too)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, width))

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True) * self.weight


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
        self.norm = _ScaleNorm(8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def no_weight_decay(self):  # timm's way of naming more no-decay parameters
        return {"pos_embed"}

    def forward(self, x):
        return self.head(self.ln(self.norm(self.embed(x) + self.pos_embed)))


def test_embeddings_decay_and_norms_by_name_and_timms_list_do_not():
    model = _Tiny()
    decay, no_decay = param_groups(model, "no_decay_norm_bias", 0.1)
    assert _names(model, decay) == {"embed.weight", "head.weight"}  # nanoGPT, HF Trainer: embeddings decay
    assert _names(model, no_decay) == {"pos_embed", "norm.weight", "ln.weight", "ln.bias", "head.bias"}


def test_none_is_one_group_of_the_trainable_parameters():
    model = _resnet18()
    (group,) = param_groups(model, None, 0.1)
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]


# ----------------------------------------------------------------------------- the user's groups


def test_a_function_names_the_backbone_at_a_lower_lr_and_the_schedule_scales_both():
    model = _resnet18()
    groups = param_groups(model, backbone_and_head, 0.1)
    assert _names(model, groups[1]) == {"fc.weight", "fc.bias"} and len(_names(model, groups[0])) == 60
    cfg = TrainConfig(optimizer="sgd", lr=0.1, lr_scaling=None, warmup_epochs=0, lr_schedule="step",
                      lr_step_epochs=1, lr_step_gamma=0.5)
    optimizer = build_optimizer(groups, cfg.optim)
    assert [g["lr"] for g in optimizer.param_groups] == [0.001, 0.1]  # the group's own lr wins
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch=1, epochs=2)
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.0005, 0.05])

    by_string = param_groups(model, "test_param_groups:backbone_and_head", 0.1)  # as a YAML config names it
    assert [[id(p) for p in g["params"]] for g in by_string] == [[id(p) for p in g["params"]] for g in groups]


def test_a_factory_optimizer_receives_the_groups():
    model = _resnet18()
    cfg = TrainConfig(optimizer="test_param_groups:rmsprop", lr=0.1, lr_scaling=None)
    optimizer = build_optimizer(param_groups(model, backbone_and_head, 0.0), cfg.optim)
    assert isinstance(optimizer, torch.optim.RMSprop) and [g["lr"] for g in optimizer.param_groups] == [0.001, 0.1]


def rmsprop(params, lr):
    return torch.optim.RMSprop(params, lr=lr)


def test_a_frozen_backbone_stays_out_of_the_optimizer_and_unchanged():
    model = _resnet18()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    groups = param_groups(model, None, 0.1)
    assert _names(model, groups[0]) == {"fc.weight", "fc.bias"}
    optimizer = build_optimizer(groups, TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.1).optim)
    # Gradients left from before the freeze: an optimizer holding the backbone would decay and move it.
    for p in model.parameters():
        p.grad = torch.ones_like(p) if not p.requires_grad else None
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {"fc.weight", "fc.bias"}


def test_fsdp2_parameters_group_by_their_names(gloo_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    fully_shard(model)
    decay, no_decay = param_groups(model, "no_decay_norm_bias", 0.1)
    assert _names(model, decay) == {"0.weight", "2.weight"}
    assert _names(model, no_decay) == {"0.bias", "1.weight", "1.bias", "2.bias"}
    groups = param_groups(model, lambda m: [{"params": ["0.weight", "0.bias"], "lr": 0.0},
                                            {"params": ["1.weight", "1.bias", "2.weight", "2.bias"]}], 0.1)
    optimizer = build_optimizer(groups, TrainConfig(optimizer="adamw", lr=0.1).optim)
    before = [model[i].weight.full_tensor().clone() for i in (0, 2)]
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert torch.equal(model[0].weight.full_tensor(), before[0])  # lr 0 in its group
    assert not torch.equal(model[2].weight.full_tensor(), before[1])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("groups, message", [
    ([], r"returned \[\]: return a non-empty list of group dicts"),
    ({"params": ["fc.weight"]}, r"return a non-empty list of group dicts"),
    ([{"lr": 0.1}], r"group 0 is \{'lr': 0.1\}, not a dict with 'params'"),
    ([{"params": ["fc.wieght"]}], r"group 0 names 'fc.wieght', which is not a parameter of the model "
                                  r"\(model.named_parameters\(\)\). Did you mean 'fc.weight'"),
    ([{"params": [nn.Parameter(torch.zeros(1))]}], r"group 0 holds a Parameter that is not a parameter of the model"),
    ([{"params": ["fc.weight", "fc.bias"]}, {"params": ["fc.weight"]}],
     r"'fc.weight' is in group 0 and group 1. Put each parameter in one group"),
    ([{"params": ["fc.weight"]}], r"61 trainable parameter\(s\) in no group \(conv1.weight, bn1.weight, bn1.bias, "
                                  r"layer1.0.conv1.weight, layer1.0.bn1.weight and 56 more\). Add them to a group, or "
                                  r"freeze them"),
])
def test_wrong_groups_name_the_problem_and_the_fix(groups, message):
    model = _resnet18()
    with pytest.raises(ValueError, match=r"param_groups='test_param_groups:.*" + message):
        param_groups(model, lambda m: groups, 0.1)


def test_a_frozen_parameter_in_a_group_is_named_frozen():
    model = _resnet18()
    model.conv1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"group 0 lists 'conv1.weight', which is frozen \(requires_grad=False\). "
                                         r"Leave it out of the groups, or unfreeze it"):
        param_groups(model, backbone_and_head, 0.1)


def test_unknown_rules_and_failing_functions_are_named():
    model = _resnet18()
    with pytest.raises(ValueError, match=r"param_groups='no_decay' is not a known rule. Use None, "
                                         r"'no_decay_norm_bias', a function"):
        param_groups(model, "no_decay", 0.1)
    with pytest.raises(ValueError, match=r"param_groups=3 is a int"):
        param_groups(model, 3, 0.1)
    with pytest.raises(ValueError, match=r"'os' is a standard-library module"):
        param_groups(model, "os:system", 0.1)
    with pytest.raises(ValueError, match=r"param_groups='test_param_groups:_broken' failed: _broken\(model\) raised "
                                         r"KeyError"):
        param_groups(model, "test_param_groups:_broken", 0.1)


def test_a_model_with_every_parameter_frozen_has_nothing_to_train():
    model = _resnet18().requires_grad_(False)
    with pytest.raises(ValueError, match=r"every parameter of the ResNet is frozen \(requires_grad=False\), so there "
                                         r"is nothing to train"):
        param_groups(model, None, 0.1)


def _broken(model):
    return {}["backbone"]


def test_build_optimizer_refuses_mixed_or_empty_groups():
    cfg = TrainConfig(optimizer="sgd").optim
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"mixes parameter groups \(dicts\) and bare parameters"):
        build_optimizer([{"params": [layer.weight]}, layer.bias], cfg)
    with pytest.raises(ValueError, match=r"parameter group\(s\) \[1\] have no 'params' entry"):
        build_optimizer([{"params": [layer.weight]}, {"lr": 0.1}], cfg)
    optimizer = build_optimizer(layer.parameters(), cfg)  # today's callers: a generator of parameters
    assert len(optimizer.param_groups) == 1 and len(optimizer.param_groups[0]["params"]) == 2
