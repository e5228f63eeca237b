"""``train`` on megatron-core's own datasets with Megatron's flags (megatron/datasets.py): an
indexed .bin/.idx dataset written by megatron-core's IndexedDatasetBuilder, read through
BlendedMegatronDatasetBuilder's GPTDataset with a NullTokenizer, and MockGPTDataset."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_cli
from exactness import check, train_tolerance

VOCAB = 100  # NullTokenizer's --vocab-size: ids 0..99, end of document 100
COMMON = ["--train-iters", "3", "--pp", "2", "--num-layers", "4", "--seq-length", "64"]


def write_dataset(prefix: Path, documents: int = 300) -> None:
    """Documents of consecutive ids (a random start, a random length), each ended by the
    end-of-document id: learnable, so the loss falls in a few steps."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for _ in range(documents):
        length = int(rng.integers(20, 200))
        ids = (int(rng.integers(0, VOCAB)) + numpy.arange(length)) % VOCAB
        builder.add_document(numpy.append(ids, VOCAB), [length + 1])
    builder.finalize(f"{prefix}.idx")


def train(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["train", *args], timeout=300)


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    path = tmp_path / "corpus" / "text_document"
    path.parent.mkdir()
    write_dataset(path)
    return path


def test_samples_go_out_in_megatron_sampler_order(prefix: Path) -> None:
    """DP rank d takes microbatches d, d + DP, ... of the one sample stream, from the samples a
    resumed run consumed; the model's vocabulary is the tokenizer's padded as Megatron pads it."""
    import torch

    from megatron_pp_ext.megatron import datasets

    options = datasets.DataOptions(
        data_path=(str(prefix),), split="98,2,0", tokenizer_type="NullTokenizer", vocab_size=VOCAB
    )
    assert datasets.check(options, None, tp=1) == 128
    assert datasets.check(options, None, tp=2) == 256
    train_set, _, _ = datasets.build_datasets(options, seed=1234, seq_length=64, samples=[32, 0, 0])
    whole = list(itertools.islice(datasets.microbatches(train_set, 2, 1, 0), 8))
    shares = [list(itertools.islice(datasets.microbatches(train_set, 2, 2, rank), 4)) for rank in (0, 1)]
    interleaved = [batch for pair in zip(*shares, strict=True) for batch in pair]
    for got, want in zip(interleaved, whole, strict=True):
        assert all(torch.equal(got[key], want[key]) for key in want)
    assert set(whole[0]) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert whole[0]["tokens"].shape == (2, 64)
    assert torch.equal(whole[0]["tokens"][:, 1:], whole[0]["labels"][:, :-1])
    resumed = next(datasets.microbatches(train_set, 2, 2, 1, first_sample=8))
    assert torch.equal(resumed["tokens"], whole[5]["tokens"])  # samples 10, 11


@pytest.mark.slow
def test_trains_on_an_indexed_dataset_and_dp2_gives_the_dp1_losses(prefix: Path, tmp_path: Path) -> None:
    """PP2 and PP2 x DP2 on the same global batches, with a validation loss (--eval-interval,
    forward only through the schedule) after iteration 2: the same training and validation losses."""
    data = ["--data-path", str(prefix), "--split", "98,2,0", "--tokenizer-type", "NullTokenizer"]
    data += [
        "--vocab-size",
        str(VOCAB),
        "--global-batch-size",
        "8",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
    ]
    runs, validations = {}, {}
    for name, layout in {"dp1": [], "dp2": ["--data-parallel-size", "2"]}.items():
        metrics = tmp_path / f"{name}.jsonl"
        done = train(*COMMON, *data, *layout, "--metrics", str(metrics))
        assert done.returncode == 0, done.stderr[-3000:]
        assert " validation loss at iteration 2 | lm loss value: " in done.stdout
        runs[name] = losses(metrics)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        validations[name] = [row["validation_loss"] for row in rows if "validation_loss" in row]
    assert len(runs["dp1"]) == 3 and all(math.isfinite(loss) for loss in runs["dp1"])
    assert runs["dp1"][-1] < runs["dp1"][0]
    assert len(validations["dp1"]) == 1 and math.isfinite(validations["dp1"][0])
    limit = train_tolerance(steps=3, global_batch=8, num_layers=4, seq_length=64)
    for step, (got, want) in enumerate(zip(runs["dp2"], runs["dp1"], strict=True)):
        check(abs(got - want) / abs(want), limit, f"dp2 step {step + 1} loss")
    got, want = validations["dp2"][0], validations["dp1"][0]
    check(abs(got - want) / abs(want), limit, "dp2 validation loss")


@pytest.mark.slow
def test_mock_data_trains(tmp_path: Path) -> None:
    metrics = tmp_path / "mock.jsonl"
    done = train(
        *COMMON, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--metrics", str(metrics),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(metrics)) == 3 and all(math.isfinite(loss) for loss in losses(metrics))


@pytest.mark.slow
def test_a_run_resumed_on_an_indexed_dataset_takes_the_next_samples(prefix: Path, tmp_path: Path) -> None:
    """--save, then --load --ckpt-step 2 of the same command: the checkpoint's consumed samples
    put the dataset where the run was, so iterations 3 and 4 lose exactly what the uninterrupted
    run's did (a resume that restarted the data would see the first samples again)."""
    data = ["--data-path", str(prefix), "--split", "98,2,0", "--tokenizer-type", "NullTokenizer"]
    data += ["--vocab-size", str(VOCAB), "--global-batch-size", "8", "--train-iters", "4"]
    command = [*COMMON[2:], *data, "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    whole = tmp_path / "whole.jsonl"
    done = train(*command, "--metrics", str(whole))
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed.jsonl"
    done = train(*command, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2", "--metrics", str(resumed))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded" in done.stdout and "at iteration 2" in done.stdout, done.stdout
    rows = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [3, 4]
    assert losses(resumed) == losses(whole)[2:]
    assert losses(whole)[2] != losses(whole)[0]


def write_hugging_face_tokenizer(directory: Path, words: int = 60) -> Any:
    """A word-level Hugging Face tokenizer (``w0`` .. ``w{words-1}``, ``<eos>`` ends a document),
    saved as ``save_pretrained`` writes it, built offline with the ``tokenizers`` library."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


@pytest.mark.slow
def test_trains_on_text_tokenized_by_a_local_hugging_face_tokenizer(tmp_path: Path) -> None:
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: documents tokenized with it
    (as Megatron-LM's tools/preprocess_data.py does) train, the model's vocabulary is the
    tokenizer's padded as Megatron pads it, and the loss falls."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_pp_ext.megatron import datasets

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = write_hugging_face_tokenizer(tokenizer_dir)
    prefix = tmp_path / "corpus" / "text_document"
    prefix.parent.mkdir()
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for _ in range(200):
        start, length = int(rng.integers(0, 60)), int(rng.integers(20, 120))
        text = " ".join(f"w{(start + i) % 60}" for i in range(length))
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        builder.add_document(numpy.array(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    options = datasets.DataOptions(
        data_path=(str(prefix),), tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir)
    )
    assert datasets.check(options, None, tp=1) == 128  # 62 ids, padded to 128
    metrics = tmp_path / "hf.jsonl"
    done = train(
        *COMMON, "--data-path", str(prefix), "--split", "98,2,0", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer_dir), "--global-batch-size", "8", "--metrics", str(metrics),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    trained = losses(metrics)
    assert len(trained) == 3 and all(math.isfinite(loss) for loss in trained) and trained[-1] < trained[0]
