"""``compile``: ``True`` wraps the whole model in ``torch.compile`` (after DDP/FSDP), ``"blocks"`` compiles each block
in place (``models/checkpointing.compile_blocks``). Both with the default inductor backend (on CPU: a C++ compiler),
each against eager: the same losses. ``"blocks"`` keeps the state dict's names and shares one graph among blocks of
the same shapes (``test_compile_blocks_keeps_the_modules_their_classes_and_names``); with fsdp on 2 ranks (local
gloo processes, no Ray) it trains the curve eager fsdp does.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import raytrain_mgpu as rtm
from raytrain_mgpu.cli import _build_parser
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.checkpointing import BLOCKS_COMPILE_FROM, compile_blocks
from raytrain_mgpu.driver.preflight import check_model_builds

# 5 blocks: Flatten, Linear+ReLU (64 -> 16), two Linear+ReLU (16 -> 16), the classifier; 22 steps an epoch
DP = dict(model="mlp", model_kwargs={"widths": [16, 16, 16]}, dataset="digits", batch_size=64, epochs=1, use_gpu=False)
CLOSE = dict(rel=1e-4, abs=1e-4)


def _in_process(storage: str, **fields) -> rtm.TrainResult:
    cfg = rtm.TrainConfig(**{**DP, **fields, "num_workers": 1, "runner": "local", "storage_path": storage})
    return rtm.fit(cfg, stream=io.StringIO())


blocks_compile = pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < BLOCKS_COMPILE_FROM,
                                    reason=f"compile='blocks' needs torch >= {BLOCKS_COMPILE_FROM}")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _assert_same_curve(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], **CLOSE)
        assert y["test_loss"] == pytest.approx(x["test_loss"], **CLOSE)


@pytest.mark.slow
def test_compile_with_inductor_trains_the_curve_eager_does(tmp_path):
    eager = _in_process(str(tmp_path / "eager"), epochs=2)
    before = _graphs()
    compiled = _in_process(str(tmp_path / "compiled"), epochs=2, compile=True)
    assert _graphs() > before
    _assert_same_curve(eager.history, compiled.history)


def six_layers(input_shape, num_classes):
    """A user's plain nn.Sequential: six blocks of five classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, num_classes))


@pytest.mark.slow
@blocks_compile
def test_compile_blocks_compiles_each_block_in_place_and_trains_the_curve_eager_does(tmp_path):
    eager = _in_process(str(tmp_path / "eager"), model=six_layers, model_kwargs={})
    before = _graphs()
    blocks = _in_process(str(tmp_path / "blocks"), model=six_layers, model_kwargs={}, compile="blocks")
    # a graph for each block in training and in evaluation: more than dynamo's 8 a code object by default (all
    # blocks' compiled calls are nn.Module._call_impl), after which it would have run the rest eagerly
    assert _graphs() - before == 12
    _assert_same_curve(eager.history, blocks.history)
    # compiled in place: the checkpoint's names are the model's own (no "_orig_mod." anywhere)
    assert list(blocks.load_model().state_dict()) == list(eager.load_model().state_dict())


@blocks_compile
def test_compile_blocks_keeps_the_modules_their_classes_and_names():
    model = build_model("mlp", (1, 8, 8), 10, {"widths": [16, 16, 16]})
    names, classes = list(model.state_dict()), [type(m) for m in model]
    assert compile_blocks(model) == 5
    assert list(model.state_dict()) == names and [type(m) for m in model] == classes
    assert all(block._compiled_call_impl is not None for block in model)
    before = _graphs()
    model(torch.zeros(4, 1, 8, 8)).sum().backward()
    assert _graphs() - before == 4  # Flatten, the 64 -> 16 block, one graph for both 16 -> 16 blocks, the classifier
    assert compile_blocks(build_model("mlp", (1, 8, 8), 10, {}), dry_run=True) == 4


def test_compile_blocks_is_refused_on_a_torch_whose_module_compile_compiles_nothing(monkeypatch):
    """torch 2.10-2.13 skip nn.Module's own call in dynamo: compile='blocks' would train eagerly without a word.
    Refused with the config's model check (before Ray), naming the version and the two ways out."""
    import raytrain_mgpu.models.checkpointing as blocks

    cfg = rtm.TrainConfig(model="mlp", compile="blocks", use_gpu=False)
    monkeypatch.setattr(blocks.torch, "__version__", "2.13.0+cpu")
    with pytest.raises(ValueError, match=r"compiles nothing on torch 2.13.0\+cpu .* Upgrade torch to >=2.14, or "
                                         r"set compile=True"):
        check_model_builds(cfg, (1, 8, 8), 10)
    monkeypatch.setattr(blocks.torch, "__version__", "2.14.1")
    check_model_builds(cfg, (1, 8, 8), 10)


def test_compile_blocks_is_refused_before_ray_where_it_cannot_work():
    # a model with no blocks (torchvision's ResNet is neither an nn.Sequential nor has blocks())
    def resnet(input_shape, num_classes):
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes)

    cfg = rtm.TrainConfig(model=resnet, dataset="synthetic", input_shape=[3, 32, 32], num_classes=10,
                          compile="blocks")
    with pytest.raises(ValueError, match=r"TrainConfig.compile='blocks' compiles each block, and model ResNet "
                                         r"cannot be split .* Or set compile=True"):
        check_model_builds(cfg, (3, 32, 32), 10)
    check_model_builds(cfg.replace(compile=True), (3, 32, 32), 10)
    # DataParallel's replicas would call the first device's compiled blocks
    for strategy, workers in (("dp", 1), ("dp_balanced", 1), ("ddp2", 2)):
        with pytest.raises(ValueError, match=rf"TrainConfig.compile='blocks' with strategy='{strategy}': "
                                             r"DataParallel copies the model"):
            rtm.TrainConfig(strategy=strategy, num_workers=workers, gpus_per_worker=2, compile="blocks")
    with pytest.raises(ValueError, match=r"TrainConfig.compile='yes': must be true, false or 'blocks'"):
        rtm.TrainConfig(compile="yes")


def test_the_command_line_takes_compile_bare_or_with_a_value():
    parser = _build_parser()
    given = {args: parser.parse_args(["train", *args]).compile
             for args in (("--compile",), ("--compile", "blocks"), ("--compile", "false"))}
    assert given == {("--compile",): True, ("--compile", "blocks"): "blocks", ("--compile", "false"): False}


# ----------------------------------------------------------------------------- fsdp on 2 ranks


def _fsdp_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    histories = {}
    for mode in (False, "blocks"):
        before = _graphs()
        engine = make_engine({**DP, "strategy": "fsdp", "compile": mode, "storage_path": out,
                              "name": f"fsdp-{mode}"}, rank=rank, world=world, setup=False)
        engine.run()
        histories[mode] = (engine.state.history, _graphs() - before)
    torch.save(histories, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@blocks_compile
def test_compile_blocks_under_fsdp_trains_the_curve_eager_fsdp_does(tmp_path):
    import _forkserver
    _forkserver.start_gloo_ranks(_fsdp_rank, (str(tmp_path),))
    for rank in (0, 1):
        runs = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (eager, eager_graphs), (blocks, block_graphs) = runs[False], runs["blocks"]
        assert eager_graphs == 0 and block_graphs > 0, runs
        _assert_same_curve(eager, blocks)
