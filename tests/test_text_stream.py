"""``ingest="ray_data"`` for ``dataset="text"`` (``data/lm_blocks.py``, ``data/parquet_stream.py``): ``data
tokenize``'s blocks streamed by Ray Data in the planned order, resumable inside an epoch.

Without Ray: the read and decode functions that Ray Data's tasks run (``parquet_stream._read``, ``_decode``), called
in turn, give each rank exactly the loader path's blocks in the loader path's order, at 1 and 2 workers and after a
resume mid-epoch, with a held-out validation split; the splits evaluated are the loader path's. Documents, token ids
that are not data tokenize's blocks and another ``seq_len`` are refused before Ray with the fix. Through Ray Train
(one run on the shared Ray): 2 workers streaming text are killed in step 33, resume at the step-30 checkpoint, train
steps 31-36 only and end with the uninterrupted loader path's weights.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import raytrain_mgpu as rtm
from _lm_folders import english_documents, save_text, save_tokenizer
from raytrain_mgpu.data import build_datasets, check_data
from raytrain_mgpu.data import parquet_stream
from raytrain_mgpu.data.lm_blocks import TokenBlocks
from raytrain_mgpu.engine.loaders import base_dataset, train_loader
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler
from raytrain_mgpu.engine.stream import PlannedSampler, PlannedStream

SEQ_LEN = 32
NUM_DOCUMENTS = 600  # 1,473 blocks of 33 tokens: 1,325 train (1,193 less val_fraction=0.1), 148 test
BATCH = 64
STEPS_PER_EPOCH = 1193 // BATCH  # 18


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """English documents as Parquet, and the same tokenized by ``data tokenize`` into files of 500 blocks in row
    groups of 128 (many row groups, so that a read task reads several)."""
    from raytrain_mgpu.data import lm_tokenize

    root = tmp_path_factory.mktemp("text-stream")
    documents = english_documents(NUM_DOCUMENTS)
    tokenizer = str(save_tokenizer(root / "tokenizer", documents))
    documents_root = str(save_text(root / "documents", documents, files=2))
    raw = rtm.TrainConfig(dataset="text", data_root=documents_root, tokenizer=tokenizer, seq_len=SEQ_LEN)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_tokenize, "ROW_GROUP_ROWS", 128)
        lm_tokenize.tokenize_to_parquet(raw.data, str(root / "blocks"), rows_per_file=500)
    return SimpleNamespace(root=root, tokenizer=tokenizer, documents=documents_root, blocks=str(root / "blocks"))


def blocks_fields(corpus, **fields) -> dict:
    return {"dataset": "text", "data_root": corpus.blocks, "seq_len": SEQ_LEN, "val_fraction": 0.1, "seed": 3,
            "ingest": "ray_data", **fields}


def blocks_config(corpus, **fields) -> rtm.TrainConfig:
    return rtm.TrainConfig(**blocks_fields(corpus, **fields))


class TaskSource:
    """``ParquetStream.batches`` without Ray Data: its read task on each ``read_rows`` indices in turn, then its
    decode task on what the read gave, the micro-batches cut from the results in order (what ``preserve_order``
    and ``iter_torch_batches`` give)."""

    def __init__(self, stream, read_rows: int):
        self.stream, self.read_rows = stream, read_rows

    def batches(self, indices, epoch, micro_batch):
        indices = np.asarray(indices, np.int64)
        decoded = [parquet_stream._decode(parquet_stream._read({"data": indices[start:start + self.read_rows]},
                                                               self.stream), self.stream, epoch)
                   for start in range(0, len(indices), self.read_rows)]
        x, y = (torch.from_numpy(np.concatenate([d[key] for d in decoded])) for key in ("x", "y"))
        for start in range(0, len(x) - micro_batch + 1, micro_batch):
            yield x[start:start + micro_batch], y[start:start + micro_batch]


# ----------------------------------------------------------------------------- the stream's blocks, without Ray


@pytest.mark.parametrize("replicas", [1, 2])
def test_each_rank_streams_the_loader_paths_blocks_in_its_order_and_a_resumed_epoch_the_rest(corpus, replicas):
    loader = build_datasets(blocks_config(corpus, ingest="loader").data)  # TokenWindows: the corpus in memory
    streamed = build_datasets(blocks_config(corpus).data)  # Subset(TokenBlocks): rows of data tokenize's files
    assert isinstance(base_dataset(streamed.train), TokenBlocks) and len(streamed.train) == len(loader.train) == 1193
    source = parquet_stream.stream_source(streamed.train)
    micro, steps = BATCH // replicas, STEPS_PER_EPOCH
    for rank in range(replicas):
        planned = PlannedSampler(streamed.train, source.run_starts(), num_replicas=replicas, rank=rank, seed=3)
        sampler = ResumableSampler(loader.train, num_replicas=replicas, rank=rank, shuffle=True, seed=3,
                                   drop_last=True)
        stream = PlannedStream(planned, micro, steps, TaskSource(source, read_rows=100))
        batches = train_loader(None, loader.train, sampler, micro, torch.device("cpu"))
        for epoch, skip in ((0, 0), (1, 5 * micro)):  # epoch 1 resumed after step 5
            for each in (planned, sampler):
                each.resume_at(epoch, skip)
                each.set_epoch(epoch)
            got, want = list(stream), list(batches)[:steps - skip // micro]
            assert len(got) == len(want) == steps - skip // micro, (rank, epoch)
            for (x, y), (want_x, want_y) in zip(got, want):
                assert x.dtype == want_x.dtype == torch.int64
                assert torch.equal(x, want_x) and torch.equal(y, want_y), (rank, epoch)  # bit for bit, in order
                assert torch.equal(x[:, 1:], y[:, :-1])  # the labels: the inputs shifted by one


def test_the_evaluated_splits_are_the_loader_paths_blocks(corpus):
    loader = build_datasets(blocks_config(corpus, ingest="loader").data)
    streamed = build_datasets(blocks_config(corpus).data)
    assert (streamed.input_shape, streamed.num_classes, streamed.seq_len) == (
        loader.input_shape, loader.num_classes, loader.seq_len)
    for split in ("test", "val"):
        want, got = getattr(loader, split), getattr(streamed, split)
        assert len(got) == len(want) > 100
        for index in range(len(want)):
            assert all(torch.equal(a, b) for a, b in zip(got[index], want[index])), (split, index)


# ----------------------------------------------------------------------------- refusals before Ray


def test_documents_other_token_ids_and_another_seq_len_are_refused_before_ray_with_the_fix(corpus, tmp_path):
    rtm.TrainConfig(dataset="text", data_root="docs", ingest="ray_data")  # the config alone: the files decide
    documents = blocks_config(corpus, data_root=corpus.documents, tokenizer=corpus.tokenizer)
    with pytest.raises(ValueError, match=r"ingest='ray_data': dataset='text' streams token blocks, and .*documents "
                                         r"holds documents \(column 'text'\), which Ray Data's tasks would tokenize "
                                         r"again every epoch\. Tokenize once: `raytrain-mgpu data tokenize "
                                         r"--data-root .*documents --tokenizer .*tokenizer --seq-len 32 --out DIR`"):
        check_data(documents.data)
    assert check_data(documents.replace(ingest="loader").data) == ((SEQ_LEN,), 512)  # the loader path tokenizes
    with pytest.raises(ValueError, match=r"TrainConfig\.seq_len=16: .*part-00000\.parquet holds blocks of seq_len=32 "
                                         r"\(data tokenize's --seq-len\).*Set seq_len=32"):
        check_data(blocks_config(corpus, seq_len=16).data)
    assert check_data(blocks_config(corpus, seq_len=16, ingest="loader").data)[0] == (16,)  # re-cut on the loader
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": list(range(i, i + 40))}) + "\n" for i in range(50)))
    with pytest.raises(ValueError, match=r"ids\.jsonl holds token ids that are not data tokenize's blocks \(JSONL, or "
                                         r"no raytrain_mgpu\.seq_len in its Parquet metadata\)"):
        check_data(blocks_config(corpus, data_root=str(ids), num_classes=100).data)


# ----------------------------------------------------------------------------- through Ray Train


def _wait_until_registered(run: Path, step: int, timeout_s: float = 60) -> None:
    """Until Ray Train has registered a checkpoint of ``step`` (or later) in ``run``, at most ``timeout_s`` (an upload
    under way when its rank dies is lost by design). Here, not imported: this module alone travels to the workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
            name = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
            if json.loads((run / name / "meta.json").read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or being replaced
            pass
        time.sleep(0.1)


def _wait_until_listed(since_s: float, names: set, timeout_s: float = 60) -> None:
    """Until Ray's state API lists a finished task of each name in ``names`` created after ``since_s``, at most
    ``timeout_s``. A rank owns its stream's tasks and reports their events about once a second; Ray Train ends its
    workers with ``ray.kill``, so a rank whose last second's events are still buffered loses them: the rank waits."""
    from ray.util.state import list_tasks
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = {task.name for name in names
                  for task in list_tasks(address=ray.get_runtime_context().gcs_address, detail=True, limit=10_000,
                                         filters=[("name", "=", name), ("state", "=", "FINISHED")],
                                         raise_on_missing_output=False)
                  if (task.creation_time_ms or 0) >= since_s * 1000}
        if names <= listed:
            return
        time.sleep(0.5)


class _KillOnce(nn.Module):
    """Inside a Ray Train worker, records each training forward of real tensors (``forwards-<pid>``: not the FLOPs
    count's on ``meta``) and, on the ``after_forwards``-th, once per probe folder (``died``), waits until Ray Train
    has registered a checkpoint of step ``registered`` in ``run`` and SIGKILLs its process. A process started after
    that death waits at its ``listed_at``-th forward until Ray lists its stream's tasks (``_wait_until_listed``)."""

    def __init__(self, probe: str, after_forwards: int, run: str = "", registered: int = 0, listed_at: int = 0):
        super().__init__()
        self.probe, self.after_forwards, self.run, self.registered = Path(probe), after_forwards, Path(run), registered
        self.listed_at, self.forwards = listed_at, 0

    def forward(self, logits):
        import ray

        if not (self.training and logits.device.type != "meta" and ray.is_initialized()
                and ray.get_runtime_context().get_actor_id() is not None):
            return logits
        self.forwards += 1
        with open(self.probe / f"forwards-{os.getpid()}", "a") as record:
            record.write(f"{time.time()}\n")
        if self.forwards == self.after_forwards and not (self.probe / "died").exists():
            _wait_until_registered(self.run, self.registered)
            (self.probe / "died").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.forwards == self.listed_at and (self.probe / "died").exists():
            _wait_until_listed(float((self.probe / "died").read_text()), {"MapBatches(_read)", "MapBatches(_decode)"})
        return logits


def lm_dying_once(input_shape, num_classes, probe: str, after_forwards: int, run: str = "", registered: int = 0,
                  listed_at: int = 0):
    from raytrain_mgpu.models.transformer import TransformerLM

    model = TransformerLM(seq_len=input_shape[0], vocab_size=num_classes, num_layers=1, hidden=32, num_heads=2)
    return model.append(_KillOnce(probe, after_forwards, run, registered, listed_at))


@pytest.mark.ray
@pytest.mark.slow
def test_two_workers_streaming_text_killed_in_step_33_resume_at_step_30_and_end_with_the_loader_paths_weights(
        ray_session, corpus, tmp_path, storage):
    """Data tokenize's blocks, 2 CPU workers, a validation split, step checkpoints every 6 steps: a worker is
    SIGKILLed in step 33 and ``max_failures=1`` restarts the group from the step-30 checkpoint (12 of epoch 2's 18
    steps done); each new worker trains steps 31-36 only, from Ray Data's tasks, and the run ends with the weights
    and the evaluations of the loader path's uninterrupted run on one worker."""
    from _reference import train_one_worker
    from test_ingest_placement import _stream_tasks

    probe = tmp_path / "probe"
    probe.mkdir()
    common = dict(model=lm_dying_once, model_kwargs={"probe": str(tmp_path), "after_forwards": 10**9}, batch_size=BATCH,
                  optimizer="sgd", momentum=0.9, lr=0.1, epochs=2, use_gpu=False)
    want, _, _, loaded = train_one_worker(blocks_fields(corpus, ingest="loader", **common))
    fields = blocks_fields(corpus, **common, num_workers=2, checkpoint_every_n_steps=6, max_failures=1)
    fields["model_kwargs"] = {"probe": str(probe), "after_forwards": 33, "run": f"{storage}/text-stream",
                              "registered": 30, "listed_at": 36 - 30}
    result = rtm.fit(rtm.TrainConfig(**fields, name="text-stream", storage_path=storage))
    died = float((probe / "died").read_text())
    records = sorted((path.read_text().split() for path in probe.glob("forwards-*")), key=lambda lines: lines[0])
    assert [len(lines) for lines in records[2:]] == [36 - 30] * 2  # the new workers: steps 31-36, none again
    assert len(records) == 4 and max(len(lines) for lines in records[:2]) == 33
    tasks = _stream_tasks(ray_session, int(died * 1000), {"MapBatches(_read)", "MapBatches(_decode)"})
    assert {"MapBatches(_read)", "MapBatches(_decode)"} <= {task.name for task in tasks}  # the resumed run streamed
    assert [(row["step"], row["attempt"]) for row in result.history] == [(STEPS_PER_EPOCH, 0), (36, 1)]
    got = result.load_model().state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6 * float(value.abs().max()), msg=key)
    for row, reference in zip(result.history, loaded, strict=True):  # the resumed epoch's sums went on from step 30
        evaluated = [key for key in reference if key.endswith(("loss", "perplexity", "accuracy"))]
        assert "val_perplexity" in evaluated and "train_loss" in evaluated
        for key in evaluated:
            assert row[key] == pytest.approx(reference[key], rel=1e-6), key
