"""Training text and byte-level batches for the ``train`` command.

Default corpus: the docstrings of a fixed list of Python standard-library modules, so every
machine that runs this has the same real English text without a download. ``--data FILE`` uses
any text file instead. Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator

import torch

STDLIB_MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar cmd codecs collections configparser "
    "contextlib copy csv dataclasses datetime decimal difflib doctest email enum filecmp fnmatch "
    "fractions functools getopt gettext glob gzip hashlib heapq hmac html http.client inspect io "
    "ipaddress itertools json locale logging lzma math mimetypes numbers operator optparse os "
    "pathlib pdb pickle plistlib pprint queue random re sched secrets selectors shlex shutil "
    "signal socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading "
    "timeit tokenize trace tracemalloc types typing unittest urllib.parse uuid warnings weakref "
    "zipfile"
).split()

VOCAB_SIZE = 256


def stdlib_corpus() -> str:
    """Module, class and function docstrings of :data:`STDLIB_MODULES`, in a fixed order."""
    parts: list[str] = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        parts.append(inspect.getdoc(module) or "")
        for _, member in sorted(vars(module).items()):
            if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(
                member, "__module__", None
            ) == module.__name__:
                doc = inspect.getdoc(member)
                if doc:
                    parts.append(doc)
    return "\n\n".join(part for part in parts if part)


def load_text(path: str | None) -> str:
    if path is None:
        return stdlib_corpus()
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


def split_train_valid(
    tokens: torch.Tensor, valid_fraction: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(tokens) * (1 - valid_fraction))
    return tokens[:cut], tokens[cut:]


def batches(
    tokens: torch.Tensor, seq_length: int, micro_batch_size: int, seed: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless microbatches of random windows: tokens, next-token labels, loss mask, positions.
    The same seed gives the same stream on every rank, so each chunk's iterator agrees."""
    if len(tokens) <= seq_length + 1:
        raise ValueError(
            f"--data: the corpus has {len(tokens)} tokens, fewer than --seq-length {seq_length} + 1"
        )
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    while True:
        starts = torch.randint(0, len(tokens) - seq_length - 1, (micro_batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + seq_length + 1] for s in starts.tolist()])
        yield {
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_length),
            "position_ids": positions,
        }


def data_parallel_share(
    stream: Iterator[dict[str, torch.Tensor]], dp: int, dp_rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Every ``dp``-th microbatch of ``stream`` from ``dp_rank`` on: Megatron's pretraining sampler
    hands data-parallel rank d the d-th micro batch of each group of DP consecutive ones."""
    for index, batch in enumerate(stream):
        if index % dp == dp_rank:
            yield batch
