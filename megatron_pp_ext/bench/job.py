"""The bench's job: model sizes, our schedules paired with torch's, and the rows to fill.

Decided in the launching process, before any worker starts, so a bad flag fails in one line and
every rank gets the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schedule.generators import SCHEDULES, RequestError, generate
from ..schedule.ir import Schedule
from ..schedule.nccl_check import check_nccl

# Both sizes fit the 2-core CPU machine; "small" makes compute, not Python overhead, dominate.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": dict(
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=128,
            vocab_size=256,
            seq_length=32,
        ),
        "micro_batch_size": 2,
    },
    "small": {
        "model": dict(
            num_layers=8,
            hidden_size=256,
            num_attention_heads=8,
            num_kv_heads=4,
            ffn_hidden_size=704,
            vocab_size=256,
            seq_length=128,
        ),
        "micro_batch_size": 2,
    },
}


@dataclass(frozen=True)
class TorchPair:
    """A torch.distributed.pipelining schedule comparable with one of ours: its class name in
    ``torch.distributed.pipelining.schedules``, stages per rank and stage placement."""

    cls: str
    stages_per_rank: int
    placement: str  # "interleaved" (stage s on rank s mod p, torch's "loop") or "vshape"


# Our schedule -> torch's counterpart. ScheduleInterleavedZeroBubble is ZB-H1 ("ZB1P") and with
# one stage per rank it is the paper's ZB-H1; torch has no ZB-H2, no automatic ZB, no V-Min/V-Half.
PAIRS: dict[str, TorchPair] = {
    "1f1b": TorchPair("Schedule1F1B", 1, "interleaved"),
    "interleaved-1f1b": TorchPair("ScheduleInterleaved1F1B", 2, "interleaved"),
    "zb-h1": TorchPair("ScheduleInterleavedZeroBubble", 1, "interleaved"),
    "v-zb": TorchPair("ScheduleZBVZeroBubble", 2, "vshape"),
    "dualpipev": TorchPair("ScheduleDualPipeV", 2, "vshape"),
}


@dataclass
class Row:
    """One schedule of the bench: ours (or why not) and torch's counterpart (or why not)."""

    name: str
    ours: Schedule | None = None
    ours_skip: str | None = None
    torch: TorchPair | None = None
    torch_skip: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class BenchSettings:
    """Everything a worker needs; plain data so it pickles into spawned processes."""

    pp: int
    microbatches: int
    iterations: int
    warmup: int
    model_size: str
    rows: list[Row]
    output: str  # rank 0 writes the results here as JSON
    seed: int = 1234
    timeout: float = 300.0
    quiet: bool = False  # check lines to stderr (for --json)
    emulate_nccl: bool = False  # NCCL's rules on gloo for our runs (runtime/creation.py, launch_order.py)

    @property
    def model(self) -> dict[str, Any]:
        return MODEL_SIZES[self.model_size]["model"]

    @property
    def micro_batch_size(self) -> int:
        return MODEL_SIZES[self.model_size]["micro_batch_size"]


def known_names() -> list[str]:
    """Registered schedules first (registry order), then torch-paired names not registered yet."""
    return list(SCHEDULES) + [name for name in PAIRS if name not in SCHEDULES]


def is_sliced_family(name: str) -> bool:
    """Seq1F1B and SlimPipe (with or without interleaving): their generators live in
    ``generators/sliced.py``; at one slice they would only repeat their base schedule."""
    return SCHEDULES[name].build.__module__.rsplit(".", 1)[-1] == "sliced"


def plan_row(name: str, pp: int, microbatches: int, num_layers: int) -> Row:
    """Decide what runs for ``name``: our schedule if it is registered, whole-sequence and fits
    the model; torch's counterpart if there is one (its own constraints are checked on the ranks)."""
    from ..megatron.model import split_layers

    row = Row(name=name, torch=PAIRS.get(name))
    if row.torch is None:
        row.torch_skip = "torch.distributed.pipelining has no counterpart"
    if name not in SCHEDULES:
        row.ours_skip = "not in this build's schedule registry"
        return row
    if is_sliced_family(name):
        row.ours_skip = "sequence-sliced family; the bench compares whole-sequence schedules"
        return row
    try:
        schedule = generate(name, pp, microbatches)
    except RequestError as error:
        row.ours_skip = f"{error.flag}: {error}"
        return row
    try:
        split_layers(num_layers, schedule.num_stages)
    except ValueError as error:
        row.ours_skip = f"{error} (--model-size)"
        return row
    hang = check_nccl(schedule, strict=False, warmed=True)  # as the runtime runs it (docs/nccl.md)
    if hang is not None:
        row.ours_skip = f"would hang under NCCL: {hang.message()}"
        return row
    row.ours = schedule
    pair = row.torch
    if pair is not None and (
        pair.stages_per_rank != schedule.vpp or pair.placement != schedule.placement.style
    ):
        row.notes.append(
            f"placement differs: ours v={schedule.vpp} {schedule.placement.style}, "
            f"torch v={pair.stages_per_rank} {pair.placement}"
        )
    return row
