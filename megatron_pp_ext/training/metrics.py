"""What a training run shows and records: Megatron-LM's log lines, the progress bar, the
``--metrics`` JSON lines, TensorBoard's scalars (``logs.py``), and each rank's steady-state
figures at the end. Formatting only: the job (``job.py``) decides what happened, this module
says it, on the one rank that shows the loss."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch
from tqdm import tqdm

from .. import launch
from ..logs import Logs
from ..megatron.optimizer import StepInfo

if TYPE_CHECKING:  # for annotations only: no import edge, a shorter import chain
    from .settings import TrainSettings

METRICS = (
    "iteration",
    "loss",
    "step_time",
    "wall_time",
    "grad_norm",
    "skipped",
    "rolled_back",
    "restarted",
    "offloaded_bytes",
)


def log_line(row: dict[str, Any], iterations: int) -> str:
    """An iteration as Megatron-LM's training log prints it (the fields ``train`` has)."""
    return (
        f" iteration {row['iteration']:8d}/{iterations:8d} |"
        f" consumed samples: {row['samples']:12d} |"
        f" elapsed time per iteration (ms): {row['step_time'] * 1000:.1f} |"
        f" learning rate: {row['learning_rate']:.6E} |"
        f" global batch size: {row['batch_size']:5d} |"
        f" lm loss: {row['loss']:.6E} |"
        f" grad norm: {row['grad_norm']:.3f} |"
        f" number of skipped iterations: {int(row['skipped']):3d} |"
    )


def validation_line(iteration: int, loss: float) -> str:
    """A validation loss as Megatron-LM's ``evaluate_and_print_results`` prints it."""
    ppl = math.exp(min(20, loss))
    return (
        f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    )


class TrainLog:
    """The run's output on the rank that shows the loss (``shows``; elsewhere it writes nothing):
    the progress bar with Megatron-LM's lines above it, ``--metrics`` and ``--tensorboard-dir``.
    ``first``: the first iteration this run trains (after a resume, the metrics file is appended)."""

    def __init__(self, settings: TrainSettings, shows: bool, first: int) -> None:
        self.settings, self.shows = settings, shows
        self.progress = tqdm(
            total=settings.iterations,
            initial=first - 1,
            desc="train",
            unit="it",
            disable=not shows,
            file=sys.stdout,
            dynamic_ncols=True,
        )
        self.metrics_file: TextIO | None = (
            open(settings.metrics, "a" if first > 1 else "w") if settings.metrics and shows else None
        )
        self.logs = Logs(settings.tensorboard_dir if shows else None, settings.log_validation_ppl)

    def write(self, line: str) -> None:
        """A line above the progress bar."""
        if self.shows:
            self.progress.write(line)

    def iteration(self, row: dict[str, Any], step: StepInfo, skipped_so_far: int) -> None:
        """An iteration's row, completed with its settled optimizer step: the bar's postfix, a
        skipped step's line, Megatron-LM's lines every ``--log-interval`` and after a validation,
        the metrics row and TensorBoard's scalars."""
        if not self.shows:
            return
        progress = self.progress
        iteration, loss = row["iteration"], row["loss"]
        postfix = {
            "loss": f"{loss:.3f}",
            "step": f"{row['step_time']:.2f}s",
            "gnorm": f"{step.grad_norm:.2f}",
        }
        if skipped_so_far:
            postfix["skipped"] = str(skipped_so_far)
        progress.set_postfix(postfix)
        if step.skipped:
            progress.write(
                f"iteration {iteration}: optimizer step skipped: gradient norm {step.grad_norm} "
                f"(NaN/inf), loss {loss}; {skipped_so_far} skipped so far"
            )
        if iteration % self.settings.log_interval == 0:
            progress.write(log_line(row, self.settings.iterations))
        if "validation_loss" in row:
            line = validation_line(iteration, row["validation_loss"])
            progress.write("\n".join(("-" * len(line), line, "-" * len(line))))
            self.logs.validation(iteration, row["samples"], row["validation_loss"])
        progress.update(1)
        if self.metrics_file:
            extra = ("validation_loss",) if "validation_loss" in row else ()
            self.metrics_file.write(json.dumps({key: row[key] for key in (*METRICS, *extra)}) + "\n")
            self.metrics_file.flush()
        self.logs.iteration(
            iteration,
            row["samples"],
            loss,
            row["learning_rate"],
            step.grad_norm,
            row["step_time"],
            row["batch_size"],
        )

    def close(self) -> None:
        self.progress.close()
        if self.metrics_file:
            self.metrics_file.close()
        self.logs.close()


@dataclass
class RankFigures:
    """This rank's figures over the run, from the hook's last result after each step: step
    times, bubble fractions, the activation peak, offloaded bytes, attention pairs (own, served,
    handed away: last step) and communicators (warmed, seconds, emulated)."""

    step_times: list[float] = field(default_factory=list)
    bubbles: list[float] = field(default_factory=list)
    peak_activation: int = 0
    offloaded: int | None = None
    attention: tuple[int, int, int] | None = None
    communicators: tuple[int, float, bool] | None = None
    pairs: int = 0  # overlapped F&B pairs in the last step (--overlap-moe-expert-parallel-comm)

    def measure(self, hook: Any, elapsed: float) -> None:
        result = hook.last_result
        self.step_times.append(elapsed)
        self.bubbles.append(min(1.0, hook.last_wait_seconds / elapsed))
        self.peak_activation = max(self.peak_activation, result.peak_activation_bytes)
        self.offloaded = result.offload.offloaded_bytes if result.offload is not None else None
        if result.attention is not None:
            self.attention = result.attention.totals()
        self.pairs = result.pairs
        creation = hook.last_creation
        self.communicators = (len(creation.created), creation.warm_up_seconds, creation.emulate)


def report_ranks(
    rank: int, settings: TrainSettings, schedule: Any, figures: RankFigures, device: torch.device
) -> list[dict[str, Any]]:
    """Print every rank's steady-state figures on rank 0; return them (every rank gets all)."""
    step_times, bubbles = figures.step_times, figures.bubbles
    steady = step_times[1:] or step_times
    row = {
        "rank": rank,
        "step_time": sum(steady) / len(steady),
        "bubble": (sum(bubbles[1:] or bubbles) / len(bubbles[1:] or bubbles)) if bubbles else None,
        "peak_activation_mib": figures.peak_activation / 2**20,
        "offloaded_mib": None if figures.offloaded is None else figures.offloaded / 2**20,
        "attention": figures.attention,
        "communicators": figures.communicators,
        "pairs": figures.pairs,
        "max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    rows = launch.gather_objects(row)
    if rank == 0:
        sp = " sp" if settings.sequence_parallel else ""
        cp = f" cp={settings.cp}" if settings.cp > 1 else ""
        print(
            f"\n{schedule.name}: pp={settings.pp} tp={settings.tp}{sp}{cp} "
            f"dp={settings.dp} m={settings.microbatches} v={schedule.vpp} "
            f"k={schedule.slices}, steady-state per rank:"
        )
        for item in rows:
            bubble = "n/a" if item["bubble"] is None else f"{item['bubble']:.3f}"
            gpu = (
                ""
                if item["max_allocated_mib"] is None
                else f"  cuda max allocated {item['max_allocated_mib']:.1f} MiB"
            )
            moved = ""
            if item["offloaded_mib"] is not None:
                moved = f"  offloaded {item['offloaded_mib']:.2f} MiB/step"
            if item["attention"] is not None and settings.pipeline.attn_redistribution:
                own, served, away = (n / 1e6 for n in item["attention"])
                moved += f"  attention Mpairs computed {own + served:.3g} (served {served:.3g})"
                moved += f", handed away {away:.3g}"
            if item["pairs"]:
                moved += f"  overlapped pairs {item['pairs']}/step"
            if item["communicators"] is not None:
                count, seconds, emulated = item["communicators"]
                rule = ", NCCL's rules emulated" if emulated else ""
                moved += f"  communicators {count} (warm-up {seconds * 1e3:.0f} ms{rule})"
            print(
                f"  rank {item['rank']}: step {item['step_time']:.3f} s  bubble {bubble}  "
                f"peak activation {item['peak_activation_mib']:.2f} MiB{moved}{gpu}"
            )
        sys.stdout.flush()
    return rows
