"""Megatron-LM's data path for ``train``: megatron-core's own datasets and tokenizer, with
Megatron's flags.

``--data-path`` (prefixes of indexed ``.bin``/``.idx`` files, optionally weighted as Megatron
takes them: ``PREFIX`` or ``W1 PREFIX1 W2 PREFIX2 ...``) builds megatron-core's ``GPTDataset`` and,
for a weighted list, its ``BlendedDataset``, split by ``--split``; ``--mock-data`` builds its
``MockGPTDataset``. Both go through ``BlendedMegatronDatasetBuilder`` with a ``GPTDatasetConfig``
as Megatron-LM's ``pretrain_gpt.py`` fills it (``core_gpt_dataset_config_from_args``), with
megatron-core's tokenizer: ``--tokenizer-type NullTokenizer --vocab-size N`` (ids 0..N-1 and the
end-of-document id N), or ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` (a
local Hugging Face tokenizer directory, as ``save_pretrained`` writes it; the ``transformers``
package reads it; its end-of-sentence token ends a document). The model's vocabulary is the
tokenizer's padded as Megatron-LM pads it: to a multiple of ``--make-vocab-size-divisible-by`` x TP.

Samples go out as Megatron's pretraining sampler hands them: microbatch k of the run holds samples
k x MBS .. (k+1) x MBS - 1, data-parallel rank d takes the microbatches k = d (mod DP), and a
resumed run starts after the samples consumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hook import OptionError

DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's, when --data-path comes without --split
TOKENIZERS = ("NullTokenizer", "HuggingFaceTokenizer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _error(flag: str, message: str) -> OptionError:
    return OptionError(message, flag)


@dataclass(frozen=True)
class DataOptions:
    """Megatron's data flags as ``train`` takes them; plain data so it pickles into workers."""

    data_path: tuple[str, ...] | None = None
    split: str | None = None
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128

    @property
    def megatron(self) -> bool:
        """Whether train reads megatron-core's datasets (else the byte-level text of data.py)."""
        return self.data_path is not None or self.mock_data


def blend(options: DataOptions) -> tuple[list[str], list[float] | None] | None:
    """``--data-path`` as megatron-core's blend: prefixes and their weights (None: by size)."""
    from megatron.core.datasets.utils import get_blend_from_list

    if options.data_path is None:
        return None
    try:
        return get_blend_from_list(list(options.data_path))
    except (AssertionError, ValueError):
        raise _error(
            "--data-path",
            f"{' '.join(options.data_path)}: give PREFIX ... or weighted pairs W1 PREFIX1 W2 PREFIX2 ...",
        ) from None


def check(options: DataOptions, text_data: str | None, tp: int) -> int | None:
    """Every data flag and combination, each naming its flag, before any process starts. Returns
    the model's vocabulary size for megatron-core's data (the tokenizer's, padded), else None."""
    if not options.megatron:
        for flag, given in (
            ("--split", options.split is not None),
            ("--tokenizer-type", options.tokenizer_type is not None),
            ("--tokenizer-model", options.tokenizer_model is not None),
            ("--vocab-size", options.vocab_size is not None),
        ):
            if given:
                raise _error(
                    flag, "needs --data-path or --mock-data (byte-level --data text has no tokenizer)"
                )
        return None
    if text_data is not None:
        raise _error(
            "--data", "a text file is byte-level data: give --data or --data-path/--mock-data, not both"
        )
    if options.data_path is not None and options.mock_data:
        raise _error("--mock-data", "generates its own data: give --data-path or --mock-data, not both")
    if options.data_path is not None:
        if not options.data_path:
            raise _error("--data-path", "needs a dataset prefix (PREFIX.bin and PREFIX.idx)")
        prefixes, weights = blend(options)
        for prefix in prefixes:
            missing = [suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
            if missing:
                raise _error(
                    "--data-path",
                    f"{prefix}: no {' or '.join(prefix + s for s in missing)} (an indexed dataset's "
                    "prefix, as Megatron-LM's tools/preprocess_data.py writes it)",
                )
        if weights is not None and (any(w < 0 for w in weights) or not sum(weights) > 0):
            raise _error("--data-path", f"weights {weights} must be non-negative, not all zero")
    elif options.split is not None:
        raise _error("--split", "splits --data-path's datasets; --mock-data has none to split")
    if options.split is not None:
        try:
            parts = [float(part) for part in options.split.replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or not parts[0] > 0:
            raise _error(
                "--split", f"{options.split!r}: give train,valid,test weights such as 98,2,0 (train above 0)"
            )
    if options.tokenizer_type is None:
        raise _error(
            "--tokenizer-type",
            "--data-path and --mock-data need a tokenizer: --tokenizer-type NullTokenizer --vocab-size N",
        )
    if options.tokenizer_type not in TOKENIZERS:
        raise _error(
            "--tokenizer-type",
            f"{options.tokenizer_type}: train builds megatron-core's NullTokenizer (with --vocab-size) "
            "and HuggingFaceTokenizer (with --tokenizer-model DIR); train other tokenizers with "
            "Megatron-LM's pretrain_gpt.py",
        )
    if options.make_vocab_size_divisible_by < 1:
        raise _error(
            "--make-vocab-size-divisible-by", f"needs at least 1, got {options.make_vocab_size_divisible_by}"
        )
    if options.tokenizer_type == "HuggingFaceTokenizer":
        vocabulary = _check_hugging_face(options)
    else:
        if options.tokenizer_model is not None:
            raise _error(
                "--tokenizer-model", "NullTokenizer reads no tokenizer model: drop --tokenizer-model"
            )
        if options.vocab_size is None or options.vocab_size < 1:
            raise _error(
                "--vocab-size", f"NullTokenizer needs --vocab-size of at least 1, got {options.vocab_size}"
            )
        vocabulary = options.vocab_size + 1  # and the end-of-document id
    return padded_vocab_size(vocabulary, options.make_vocab_size_divisible_by, tp)


def _check_hugging_face(options: DataOptions) -> int:
    """A local tokenizer directory that ``transformers`` reads, with an end-of-sentence token;
    returns its vocabulary size."""
    if options.vocab_size is not None:
        raise _error(
            "--vocab-size", "HuggingFaceTokenizer takes its vocabulary from --tokenizer-model: drop it"
        )
    directory = options.tokenizer_model
    if directory is None:
        raise _error(
            "--tokenizer-model", "HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory)"
        )
    if not Path(directory).is_dir():
        raise _error(
            "--tokenizer-model",
            f"{directory}: not a directory; give a local Hugging Face tokenizer directory "
            "(as save_pretrained writes it)",
        )
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise _error(
            "--tokenizer-type",
            "HuggingFaceTokenizer needs the transformers package: pip install transformers",
        ) from None
    if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        raise _error(
            "--tokenizer-model",
            f"{directory}: no tokenizer in it (none of {', '.join(TOKENIZER_FILES)}); give the directory "
            "save_pretrained wrote",
        )
    try:
        tokenizer = build_tokenizer(options)
    except Exception as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise _error("--tokenizer-model", f"{directory}: transformers cannot read it: {first}") from None
    if tokenizer.eod is None:
        raise _error(
            "--tokenizer-model", f"{directory}: the tokenizer has no end-of-sentence token to end documents"
        )
    return int(tokenizer.vocab_size)


def split_weights(options: DataOptions) -> list[float]:
    """``--split`` (or Megatron-LM's default) as train, valid and test weights."""
    parts = [float(part) for part in (options.split or DEFAULT_SPLIT).replace("/", ",").split(",")]
    return [*parts, 0.0, 0.0][:3]


def padded_vocab_size(tokenizer_vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return math.ceil(tokenizer_vocab / multiple) * multiple


def build_tokenizer(options: DataOptions) -> Any:
    """megatron-core's tokenizer, as ``megatron.core.tokenizers``' build_tokenizer makes it."""
    from megatron.core.tokenizers import MegatronTokenizer

    if options.tokenizer_type == "HuggingFaceTokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=options.tokenizer_model, metadata_path={"library": "huggingface"}
        )
    assert options.tokenizer_type == "NullTokenizer", options.tokenizer_type  # check() refused others
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=options.vocab_size)


def build_datasets(options: DataOptions, seed: int, seq_length: int, samples: list[int]) -> list[Any]:
    """Train, validation and test datasets of ``samples`` samples each (0: none), through
    megatron-core's BlendedMegatronDatasetBuilder as pretrain_gpt.py builds them. Every rank builds
    them (rank 0 first, writing the index cache next to the data, then the others reading it)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend(options),
        split=options.split or DEFAULT_SPLIT,
        tokenizer=build_tokenizer(options),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the model masks causally itself
    )
    cls = MockGPTDataset if options.mock_data else GPTDataset
    return list(BlendedMegatronDatasetBuilder(cls, samples, lambda: True, config).build())


def microbatches(
    dataset: Any, micro_batch_size: int, dp: int, dp_rank: int, first_sample: int = 0
) -> Iterator[dict[str, Any]]:
    """This data-parallel rank's microbatches in Megatron's pretraining sampler order, from sample
    ``first_sample`` (a multiple of micro batch size x DP: the samples a resumed run consumed):
    dicts of [micro batch, sequence] tokens, labels, loss_mask and position_ids."""
    import torch

    keys = ("tokens", "labels", "loss_mask", "position_ids")
    start = first_sample + dp_rank * micro_batch_size
    for first in range(start, len(dataset) - micro_batch_size + 1, micro_batch_size * dp):
        samples = [dataset[index] for index in range(first, first + micro_batch_size)]
        yield {key: torch.stack([sample[key] for sample in samples]) for key in keys}
