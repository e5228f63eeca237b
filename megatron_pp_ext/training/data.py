"""The batches a training run reads: the byte-level text (``megatron_pp_ext/data.py``) or
megatron-core's datasets (``megatron/datasets.py``, with Megatron's flags), as one iterator per
model chunk, cut for this data-parallel rank."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from .. import data
from ..megatron import datasets

if TYPE_CHECKING:  # for annotations only: no import edge, a shorter import chain
    from .settings import TrainSettings


class TrainData:
    """The run's training and validation splits for this data-parallel rank. ``chunks``: the
    model chunks on this rank, one iterator each."""

    def __init__(self, settings: TrainSettings, seq_length: int, dp_rank: int, chunks: int) -> None:
        self.settings, self.seq_length, self.dp_rank, self.chunks = settings, seq_length, dp_rank, chunks
        self.datasets: list[Any] | None = None  # megatron-core's, built once, on every rank together

    def iterators(self, split: str, first_sample: int) -> list[Any]:
        """One iterator per chunk, same seed: the chunk holding the embedding reads tokens, the one
        holding the loss reads labels, of the same microbatches. Each data-parallel rank takes every
        DP-th microbatch of the one stream (Megatron's sampler order), so the global batch is the
        same at every DP size; a resumed run starts after the samples consumed (``first_sample``;
        the validation split's for "valid"). ``split``: "train" or "valid"."""
        settings = self.settings
        if settings.dataset.megatron:
            if self.datasets is None:
                global_batch = settings.iteration_samples()
                evaluations = (
                    settings.iterations // settings.eval_interval + 1 if settings.eval_interval else 0
                )
                self.datasets = datasets.build_datasets(
                    settings.dataset,
                    settings.seed,
                    self.seq_length,
                    [settings.iterations * global_batch, evaluations * settings.eval_iters * global_batch, 0],
                )
            dataset = self.datasets[("train", "valid").index(split)]
            return [
                datasets.microbatches(
                    dataset, settings.micro_batch_size, settings.dp, self.dp_rank, first_sample
                )
                for _ in range(self.chunks)
            ]
        tokens = data.encode(data.load_text(settings.data))
        train_tokens, valid_tokens = data.split_train_valid(tokens)
        if split == "valid":
            train_tokens = valid_tokens
        start = first_sample // settings.micro_batch_size
        return [
            data.data_parallel_share(
                itertools.islice(
                    data.batches(train_tokens, self.seq_length, settings.micro_batch_size, settings.seed),
                    start,
                    None,
                ),
                settings.dp,
                self.dp_rank,
            )
            for _ in range(self.chunks)
        ]
