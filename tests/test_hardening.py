"""Hardening (issue 11): no code runs from checkpoints, data or config files; bad values
stop before Ray; runs in one folder never mix."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from raytrain_mgpu import checkpoint as ckpt_format
from raytrain_mgpu.data import cifar10


class _Payload:
    """Unpickling this creates ``marker``: the proof that a file ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


# ----------------------------------------------------------------------------- code from files


def _legit_train_state() -> dict:
    model = torch.nn.Linear(4, 3)
    states = {}
    for optimizer in (torch.optim.AdamW(model.parameters(), lr=0.1),
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        states[type(optimizer).__name__] = optimizer.state_dict()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch)
    scaler = torch.amp.GradScaler("cpu")
    return {"optimizer": states, "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "torch_rng": torch.get_rng_state(), "rng_per_rank": [torch.get_rng_state(), torch.get_rng_state()]}


def test_a_legitimate_train_state_loads_with_weights_only(tmp_path):
    state = _legit_train_state()
    ckpt_format.write_checkpoint(str(tmp_path), meta={}, history=[], train_state=state, part="-stage1")
    loaded = ckpt_format.load_train_state(str(tmp_path), "-stage1")
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])
    assert loaded["optimizer"]["AdamW"]["state"][0]["step"] == state["optimizer"]["AdamW"]["state"][0]["step"]
    assert len(loaded["rng_per_rank"]) == 2 and loaded["scheduler"]["base_lrs"] == [0.1]


def test_a_planted_train_state_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(str(marker))}, tmp_path / "train_state.pt")
    with pytest.raises(ValueError, match=r"train_state.pt'.*refused without running it.*another `name`"):
        ckpt_format.load_train_state(str(tmp_path))
    assert not marker.exists()


def test_a_planted_model_part_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": _Payload(str(marker))}, tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"model.pt'.*refused without running it"):
        ckpt_format.load_model_state(str(tmp_path))
    assert not marker.exists()


def test_only_our_own_part_names_are_merged(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "model-stage0.pt")
    torch.save({"v": torch.ones(1)}, tmp_path / "model-stage1.pt")
    torch.save({"w": torch.zeros(1), "extra": torch.zeros(1)}, tmp_path / "model_backup.pt")
    state = ckpt_format.load_model_state(str(tmp_path))
    assert sorted(state) == ["v", "w"] and state["w"].item() == 1.0


def test_train_state_part_must_be_ours(tmp_path):
    with pytest.raises(ValueError, match=r"part '/../x' is not '' or '-stage<p>'"):
        ckpt_format.load_train_state(str(tmp_path), "/../x")


def _cifar_batch(n: int = 4) -> dict:
    rng = np.random.default_rng(0)
    return {b"batch_label": b"x", b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
            b"labels": list(range(n)), b"filenames": [b"a.png"] * n}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_real_cifar_batch_reads_with_the_restricted_unpickler(tmp_path, protocol):
    path = tmp_path / "data_batch_1"
    batch = _cifar_batch()
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    images, labels = cifar10.read_batch(str(path))
    assert images.shape == (4, 3, 32, 32) and labels.tolist() == [0, 1, 2, 3]
    assert np.array_equal(images.reshape(4, -1), batch[b"data"])


def test_a_planted_cifar_batch_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({**_cifar_batch(), b"labels": _Payload(str(marker))}, protocol=2))
    cifar10.check_batch_file(str(path))  # the header check alone cannot tell: it looks like a batch
    with pytest.raises(ValueError, match=r"data_batch_1: cannot be unpickled .*references posix.mkdir.*refused"):
        cifar10.read_batch(str(path))
    assert not marker.exists()
