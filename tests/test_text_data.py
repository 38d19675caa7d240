"""``dataset="text"`` (``data/lm_text.py``): Parquet or JSONL documents tokenized with a ``transformers`` tokenizer,
packed into blocks of ``seq_len + 1`` tokens; ``raytrain-mgpu data tokenize`` (``data/lm_tokenize.py``); the
refusals before Ray; a Hugging Face causal LM's loss; ``perplexity`` and ``tokens_per_s`` in the history; a resume
inside an epoch.

No network and no Ray: real English text (Python's help pages), a BPE tokenizer trained here and a tiny Llama
saved from a config (tests/_lm_folders.py); fits train in this process (``runner="local"``).
"""

from __future__ import annotations

import dataclasses
import io
import math
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

import raytrain_mgpu as rtm
from _lm_folders import VOCAB, english_documents, model_folder, save_text, save_tiny_llama, save_tokenizer
from raytrain_mgpu.cli import main
from raytrain_mgpu.data import build_datasets, check_data
from raytrain_mgpu.engine.objectives import Objective

SEQ_LEN = 32
NUM_DOCUMENTS = 600  # about 1,300 training blocks of 33 tokens


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    documents = english_documents(NUM_DOCUMENTS)
    return SimpleNamespace(root=root, documents=documents, tokenizer=str(save_tokenizer(root / "tokenizer", documents)),
                           parquet=str(save_text(root / "parquet", documents, files=2)),
                           jsonl=str(save_text(root / "jsonl", documents, files=3, kind="jsonl")))


def text_config(corpus, **fields) -> rtm.TrainConfig:
    return rtm.TrainConfig(**{"dataset": "text", "data_root": corpus.parquet, "tokenizer": corpus.tokenizer,
                              "seq_len": SEQ_LEN, **fields})


def llama_from(folder):
    """A Hugging Face causal LM from its folder, as a user's model factory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


# ----------------------------------------------------------------------------- packing and files


def test_blocks_are_the_eos_joined_token_stream_cut_exactly_and_the_labels_are_the_inputs_shifted(corpus):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(corpus.tokenizer)
    eos = tokenizer.eos_token_id
    stream = [t for doc in corpus.documents for t in tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]]
    count = len(stream) // (SEQ_LEN + 1)
    want = np.array(stream[:count * (SEQ_LEN + 1)]).reshape(count, SEQ_LEN + 1)
    held = math.ceil(count / 10)  # the test split: the last tenth of the blocks
    data = build_datasets(text_config(corpus).data)
    assert np.array_equal(data.train.tokens, want[:count - held])
    assert np.array_equal(data.test.tokens, want[count - held:])
    assert (want == eos).sum() > count // 4 and not (want == tokenizer.pad_token_id).any()  # joined by EOS, no padding
    x, y = data.train[7]
    assert torch.equal(x, torch.from_numpy(want[7, :-1]).long())
    assert torch.equal(y, torch.from_numpy(want[7, 1:]).long())  # the labels: the inputs shifted by one
    assert (data.input_shape, data.num_classes, data.seq_len) == ((SEQ_LEN,), VOCAB, SEQ_LEN)


def test_jsonl_and_parquet_shards_of_the_same_documents_give_the_same_blocks(corpus):
    parquet = build_datasets(text_config(corpus).data)
    jsonl = build_datasets(text_config(corpus, data_root=corpus.jsonl).data)  # 3 shards against 2
    assert np.array_equal(parquet.train.tokens, jsonl.train.tokens)
    assert np.array_equal(parquet.test.tokens, jsonl.test.tokens)


def test_data_tokenize_writes_input_ids_blocks_that_read_back_without_a_tokenizer_as_the_same_blocks(corpus, capsys):
    out = corpus.root / "tokenized"
    assert main(["data", "tokenize", "--data-root", corpus.jsonl, "--tokenizer", corpus.tokenizer, "--seq-len",
                 str(SEQ_LEN), "--out", str(out), "--rows-per-file", "500"]) == 0
    assert "Parquet file(s)" in capsys.readouterr().out
    files = sorted(out.glob("*.parquet"))
    table = pq.read_table(files[0])
    assert len(files) == 3 and table.column_names == ["input_ids"] and table.num_rows == 500
    assert {len(row) for row in table.column(0).to_pylist()} == {SEQ_LEN + 1}
    tokenized = rtm.TrainConfig(dataset="text", data_root=str(out), seq_len=SEQ_LEN)  # no tokenizer
    assert check_data(tokenized.data) == ((SEQ_LEN,), VOCAB)  # the vocabulary from the files' metadata
    on_the_fly, read = build_datasets(text_config(corpus).data), build_datasets(tokenized.data)
    assert np.array_equal(read.train.tokens, on_the_fly.train.tokens)
    assert np.array_equal(read.test.tokens, on_the_fly.test.tokens)


def test_train_and_test_folders_are_the_splits_and_data_tokenize_keeps_them(corpus, tmp_path):
    source = tmp_path / "split"
    save_text(source / "train", corpus.documents[:500], files=2)
    save_text(source / "test", corpus.documents[500:], files=1, kind="jsonl")
    whole = build_datasets(text_config(corpus, data_root=str(source / "train")).data)  # its own last tenth held out
    split = build_datasets(text_config(corpus, data_root=str(source)).data)
    assert np.array_equal(split.train.tokens, np.concatenate([whole.train.tokens, whole.test.tokens]))
    alone = build_datasets(text_config(corpus, data_root=str(source / "test")).data)
    assert np.array_equal(split.test.tokens, np.concatenate([alone.train.tokens, alone.test.tokens]))
    assert main(["data", "tokenize", "--data-root", str(source), "--tokenizer", corpus.tokenizer, "--seq-len",
                 str(SEQ_LEN), "--out", str(tmp_path / "out")]) == 0
    read = build_datasets(rtm.TrainConfig(dataset="text", data_root=str(tmp_path / "out"), seq_len=SEQ_LEN).data)
    assert sorted(p.parent.name for p in (tmp_path / "out").rglob("*.parquet")) == ["test", "train"]
    assert np.array_equal(read.train.tokens, split.train.tokens) and np.array_equal(read.test.tokens, split.test.tokens)


# ----------------------------------------------------------------------------- refusals before Ray


def test_a_text_column_the_files_lack_is_named_with_the_columns_they_have(corpus):
    for root in (corpus.parquet, corpus.jsonl):
        with pytest.raises(ValueError, match=r"part-00000\.(parquet|jsonl): no column 'body' \(TrainConfig\.text_column"
                                             r"\); its columns are \['text'\]\. Set text_column"):
            check_data(text_config(corpus, data_root=root, text_column="body").data)


def test_a_tokenizer_past_the_models_embeddings_and_a_seq_len_past_its_positions_are_refused(corpus, tmp_path):
    small = save_tiny_llama(tmp_path / "small-vocab", vocab_size=256)  # 512 tokens in the tokenizer
    data = dataclasses.replace(text_config(corpus).data, model=f"hf:{small}")
    with pytest.raises(ValueError, match=r"its vocabulary has 512 tokens, more than the 256 embeddings of "
                                         r"model='hf:.*small-vocab' \(.*config\.json: vocab_size\).*resize"):
        check_data(data)
    fits = save_tiny_llama(tmp_path / "llama")  # 128 positions
    with pytest.raises(ValueError, match=r"TrainConfig\.seq_len=256: longer than the 128 positions of "
                                         r"model='hf:.*llama' .*Set seq_len to 128 or less"):
        check_data(dataclasses.replace(data, model=f"hf:{fits}", seq_len=256))
    assert check_data(dataclasses.replace(data, model=f"hf:{fits}", seq_len=128)) == ((128,), VOCAB)


def test_a_data_root_without_parquet_or_jsonl_files_and_documents_without_a_tokenizer_are_refused(corpus, tmp_path):
    (tmp_path / "notes.txt").write_text("plain text")
    with pytest.raises(ValueError, match=r"data_root='.*': no Parquet \(\*\.parquet\) or JSONL \(\*\.jsonl\) files in "
                                         r".*; it holds \['notes\.txt'\]"):
        check_data(text_config(corpus, data_root=str(tmp_path)).data)
    with pytest.raises(ValueError, match=r"TrainConfig\.tokenizer=None: dataset 'text' tokenizes the documents of "
                                         r"column 'text'.*Set tokenizer to a tokenizer folder, use "
                                         r"model='hf:<folder>'"):
        check_data(text_config(corpus, tokenizer=None).data)


def test_an_hf_models_folder_gives_the_tokenizer_and_the_default_seq_len(corpus, tmp_path):
    folder = model_folder(tmp_path, corpus.documents)  # model and tokenizer files in one folder, 128 positions
    data = text_config(corpus, model=f"hf:{folder}", tokenizer=None, seq_len=None).data  # the model names the folder
    assert check_data(data) == ((128,), VOCAB)
    built = build_datasets(data)
    assert built.train.tokens.shape[1] == 129 and built.seq_len == 128


def test_text_fields_are_checked_with_the_config():
    with pytest.raises(ValueError, match=r"TrainConfig\.seq_len=64: is read by dataset='text' only, and "
                                         r"dataset='digits'"):
        rtm.TrainConfig(dataset="digits", seq_len=64)
    with pytest.raises(ValueError, match=r"TrainConfig\.seq_len=0: must be a positive integer or None"):
        rtm.TrainConfig(dataset="text", seq_len=0)
    with pytest.raises(ValueError, match=r"TrainConfig\.input_shape=\[64\]: dataset='text' takes its sequence length "
                                         r"from seq_len\. Set seq_len=64"):
        rtm.TrainConfig(dataset="text", input_shape=[64])


# ----------------------------------------------------------------------------- training on it


def test_the_cross_entropy_of_a_hugging_face_causal_lm_is_the_mean_loss_over_its_batch_seq_vocab_logits(tmp_path):
    model = llama_from(save_tiny_llama(tmp_path / "llama"))
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(2))
    outputs = model(x)
    assert outputs.logits.shape == (2, 16, VOCAB)
    objective = Objective("cross_entropy", ("accuracy",))
    torch.testing.assert_close(objective.loss(outputs, y), F.cross_entropy(outputs.logits.reshape(-1, VOCAB),
                                                                           y.reshape(-1)))
    [(correct, count)] = objective.measure(outputs, y)
    assert count == 32 and int(correct) == int((outputs.logits.argmax(-1) == y).sum())


def test_an_in_process_fit_of_a_hugging_face_llama_reports_perplexity_and_tokens_per_s_and_learns(corpus, tmp_path):
    llama = save_tiny_llama(tmp_path / "llama")
    cfg = text_config(corpus, model=llama_from, model_kwargs={"folder": str(llama)}, runner="local", num_workers=1,
                      use_gpu=False, epochs=2, batch_size=32, lr=3e-3, storage_path=str(tmp_path / "runs"))
    history = rtm.fit(cfg, stream=io.StringIO()).history
    steps = len(build_datasets(cfg.data).train) // 32
    for row in history:
        assert row["perplexity"] == pytest.approx(math.exp(row["test_loss"]), rel=1e-12)
        # every step trains 32 blocks of SEQ_LEN tokens, over the epoch's time in steps
        assert row["tokens_per_s"] * row["training_s"] == pytest.approx(steps * 32 * SEQ_LEN, rel=1e-9)
    first, second = history
    assert second["test_loss"] < first["test_loss"] < math.log(VOCAB)  # below chance, and falling
    assert second["perplexity"] < first["perplexity"]


def test_a_run_stopped_inside_an_epoch_resumes_at_its_step_checkpoint_and_ends_with_the_undisturbed_weights(corpus):
    from _failing_models import fault_once_after_step
    from _reference import train_one_worker

    common = dict(dataset="text", data_root=corpus.parquet, tokenizer=corpus.tokenizer, seq_len=SEQ_LEN,
                  model="transformer_lm", model_kwargs={"num_layers": 1, "hidden": 32, "num_heads": 2},
                  batch_size=64, optimizer="sgd", momentum=0.9, lr=0.1, epochs=2, checkpoint_every_n_steps=7)
    want, _, _, undisturbed = train_one_worker(common)
    per_epoch = undisturbed[0]["step"]  # 20 steps of 64 blocks
    with fault_once_after_step(30) as steps:
        got, _, _, history = train_one_worker({**common, "max_failures": 1})
    # resumed from the step-28 checkpoint, 8 steps into epoch 2: steps 29 and 30 again, none skipped
    assert per_epoch == 20 and steps == list(range(1, 31)) + list(range(29, 41))
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert [row["attempt"] for row in history] == [0, 1]
    assert history[1]["perplexity"] == pytest.approx(undisturbed[1]["perplexity"], rel=1e-9)
