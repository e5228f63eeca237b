"""TensorBoard logs where Megatron-LM users look: ``--tensorboard-dir``, with Megatron-LM's tags.

Per iteration, on the rank that reports the loss (Megatron-LM writes on its last rank):
``lm loss``, ``learning-rate``, ``grad-norm``, ``iteration-time`` (seconds) and ``batch-size``,
each also against consumed samples (``... vs samples``) as Megatron-LM logs them, and with
``--eval-interval`` the validation loss (``lm loss validation``, also ``vs samples``; its
perplexity too with ``--log-validation-ppl-to-tensorboard``). At the end of a
run, from the per-rank summary ``train`` prints: each pipeline rank's measured bubble and peak
activation memory (and, on a GPU, the allocator's peak), tagged per rank. Several processes may
write into one directory; TensorBoard reads every event file in it.
"""

from __future__ import annotations

import math
from typing import Any


def available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write (it needs the ``tensorboard`` package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


class Logs:
    """A ``SummaryWriter`` on ``directory``, or nothing when no directory is given."""

    def __init__(self, directory: str | None, validation_ppl: bool = False) -> None:
        self.writer: Any = None
        self.validation_ppl = validation_ppl  # Megatron's --log-validation-ppl-to-tensorboard
        if directory is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=directory)

    def iteration(
        self,
        iteration: int,
        samples: int,
        loss: float | None,
        learning_rate: float,
        grad_norm: float | None,
        seconds: float,
        batch_size: int,
    ) -> None:
        """One iteration's scalars (the loss where this rank has it)."""
        if self.writer is None:
            return
        values = {
            "lm loss": loss,
            "learning-rate": learning_rate,
            "grad-norm": grad_norm,
            "iteration-time": seconds,
            "batch-size": batch_size,
        }
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, iteration)
                if tag != "iteration-time":
                    self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def validation(self, iteration: int, samples: int, loss: float) -> None:
        """A validation loss (``--eval-interval``), as Megatron-LM's ``evaluate_and_print_results``
        tags it."""
        if self.writer is None:
            return
        self.writer.add_scalar("lm loss validation", loss, iteration)
        self.writer.add_scalar("lm loss validation vs samples", loss, samples)
        if self.validation_ppl:  # Megatron-LM caps the exponent at 20, as its printed PPL
            ppl = math.exp(min(20.0, loss))
            self.writer.add_scalar("lm loss validation ppl", ppl, iteration)
            self.writer.add_scalar("lm loss validation ppl vs samples", ppl, samples)

    def ranks(self, iteration: int, rows: list[dict[str, Any]]) -> None:
        """The run's per-rank summary: measured bubble, peak activation and GPU memory (MiB)."""
        if self.writer is None:
            return
        for row in rows:
            rank = row["rank"]
            for tag, key in (
                ("pipeline-bubble", "bubble"),
                ("mem-activation-peak-mib", "peak_activation_mib"),
                ("mem-max-allocated-mib", "max_allocated_mib"),
            ):
                if row.get(key) is not None:
                    self.writer.add_scalar(f"{tag}/rank {rank}", row[key], iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
