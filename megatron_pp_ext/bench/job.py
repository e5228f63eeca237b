"""The bench's job: model sizes, our schedules paired with torch's or Megatron's, and the rows to fill.

Decided in the launching process, before any worker starts, so a bad flag fails in one line and
every rank gets the same plan.

``moe-tiny`` is ``tiny`` with mixture-of-experts layers (4 experts, top-2, megatron-core's
alltoall token dispatcher, its load-balancing loss on), for expert parallelism: with
``--expert-model-parallel-size`` E the bench runs p x E processes, E data-parallel pipelines
whose experts are split over the E ranks of each stage. With ``--overlap-moe-expert-parallel-comm``
each of our rows also runs paired (``schedule/pairing.py``: our overlapped F&B pairs, their
all-to-alls on a communication thread on the host), beside the same schedule unpaired; against Megatron its
interleaved 1F1B row also runs megatron-core's combined 1F1B (its interleaved schedule with
``overlap_moe_expert_parallel_comm``), the counterpart of our paired interleaved 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schedule.generators import SCHEDULES, RequestError, generate
from ..schedule.ir import Schedule
from ..schedule.lowering import lower
from ..schedule.nccl_check import check_nccl
from ..schedule.offload import OffloadError, OffloadPolicy, apply_offload
from ..schedule.run_costs import RunShape, run_costs

# tiny and small fit the 2-core CPU machine ("small" makes compute, not Python overhead, dominate).
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
    # for a GPU (the `bench` phase of scripts/gpu_validate.sh): activations large enough that
    # offload copies and step times mean something; too slow for the CPU machine
    "medium": {
        "model": dict(
            num_layers=8,
            hidden_size=1024,
            num_attention_heads=16,
            num_kv_heads=4,
            ffn_hidden_size=2816,
            vocab_size=32000,
            seq_length=2048,
        ),
        "micro_batch_size": 1,
    },
}
# tiny's mixture-of-experts twin (every layer MoE); --expert-model-parallel-size sets its EP
MOE_TINY_EXPERTS = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_token_dispatcher_type="alltoall",
    moe_aux_loss_coeff=1e-2,
)
MODEL_SIZES["moe-tiny"] = {
    "model": {**MODEL_SIZES["tiny"]["model"], "extra": MOE_TINY_EXPERTS},
    "micro_batch_size": MODEL_SIZES["tiny"]["micro_batch_size"],
}


@dataclass(frozen=True)
class TorchPair:
    """A torch.distributed.pipelining schedule comparable with one of ours: its class name in
    ``torch.distributed.pipelining.schedules``, stages per rank and stage placement."""

    cls: str
    stages_per_rank: int
    placement: str  # "interleaved" (stage s on rank s mod p, torch's "loop") or "vshape"


@dataclass(frozen=True)
class MegatronPair:
    """One of megatron-core's pipeline schedules: its function in
    ``megatron.core.pipeline_parallel.schedules`` and the model chunks per rank it runs."""

    function: str
    chunks: int
    label: str
    # megatron-core's fine-grained activation offloading of these modules (TransformerConfig's
    # ``offload_modules``), tensors from ``min_offloaded_tensor_size`` bytes; () for none
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024
    # megatron-core's combined 1F1B: its interleaved schedule with overlap_moe_expert_parallel_comm
    overlap: bool = False


# Our schedule -> megatron-core's own; the others are timed against the faster of these two.
MEGATRON_PAIRS: dict[str, MegatronPair] = {
    "1f1b": MegatronPair("forward_backward_pipelining_without_interleaving", 1, "1F1B"),
    "interleaved-1f1b": MegatronPair("forward_backward_pipelining_with_interleaving", 2, "interleaved 1F1B"),
}
# With --overlap-moe-expert-parallel-comm: Megatron's A2A-overlapped schedule beside this row's
# (megatron-core runs combined 1F1B only interleaved when PP > 1).
MEGATRON_COMBINED: dict[str, MegatronPair] = {
    "interleaved-1f1b": MegatronPair(
        "forward_backward_pipelining_with_interleaving", 2, "interleaved combined-1f1b", overlap=True
    ),
}


# Our schedule -> torch's counterpart. ScheduleInterleavedZeroBubble is ZB-H1 ("ZB1P") and with
# one stage per rank it is the paper's ZB-H1; torch has no ZB-H2, no automatic ZB, no V-Min/V-Half.
PAIRS: dict[str, TorchPair] = {
    "1f1b": TorchPair("Schedule1F1B", 1, "interleaved"),
    "interleaved-1f1b": TorchPair("ScheduleInterleaved1F1B", 2, "interleaved"),
    "zb-h1": TorchPair("ScheduleInterleavedZeroBubble", 1, "interleaved"),
    "v-zb": TorchPair("ScheduleZBVZeroBubble", 2, "vshape"),
    "dualpipev": TorchPair("ScheduleDualPipeV", 2, "vshape"),
}


# `bench --against megatron` by default: Megatron's two schedules' counterparts, then what a
# user could switch to.
MEGATRON_DEFAULT = [
    *("1f1b", "interleaved-1f1b"),
    *("zb-h1", "zb-h2", "v-half", "v-zb", "dualpipev", "seq1f1b", "slimpipe"),
]
DEFAULT_SLICES = 4  # sequence slices per microbatch for Seq1F1B and SlimPipe (--pp-seq-slices)


@dataclass
class Row:
    """One schedule of the bench: ours (or why not) and the baseline's (or why not): torch's
    counterpart, or megatron-core's own schedule (``megatron`` None with ``against`` megatron:
    the faster of Megatron's two, decided once both have run)."""

    name: str
    offload: str = "none"  # our --pp-offload policy for this row (auto: k measured on each rank)
    ours: Schedule | None = None
    plain: Schedule | None = None  # with offload: ours without it, timed in the same rounds
    ours_skip: str | None = None
    torch: TorchPair | None = None
    torch_skip: str | None = None
    megatron: MegatronPair | None = None
    megatron_skip: str | None = None
    notes: list[str] = field(default_factory=list)
    # --overlap-moe-expert-parallel-comm: ours paired, and Megatron's combined 1F1B where it has one
    paired: Schedule | None = None
    paired_skip: str | None = None
    megatron_combined: MegatronPair | None = None


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
    against: str = "torch"  # the baseline: torch.distributed.pipelining or megatron-core's schedules
    count_calls: bool = False  # one more step per job under cProfile on rank 0
    distributed_backend: str | None = None  # "gloo" with GPUs: the ranks share them (launch.py)
    # Megatron's fine-grained activation offloading (its --offload-modules) against our offload rows
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024
    ep: int = 1  # expert-parallel size: the world is pp x ep processes (data-parallel ep)
    overlap: bool = False  # --overlap-moe-expert-parallel-comm: paired rows too

    @property
    def model(self) -> dict[str, Any]:
        return model_fields(self.model_size, self.ep)

    @property
    def world(self) -> int:
        return self.pp * self.ep

    @property
    def micro_batch_size(self) -> int:
        return MODEL_SIZES[self.model_size]["micro_batch_size"]


def model_fields(model_size: str, ep: int = 1) -> dict[str, Any]:
    """The ModelConfig fields of ``model_size``, a MoE model's experts split over ``ep`` ranks."""
    fields = dict(MODEL_SIZES[model_size]["model"])
    if "num_moe_experts" in fields.get("extra", {}):
        fields["extra"] = {**fields["extra"], "expert_model_parallel_size": ep}
    return fields


def experts_of(model_size: str) -> int | None:
    """The experts per MoE layer of ``model_size``; None for a dense model."""
    return MODEL_SIZES[model_size]["model"].get("extra", {}).get("num_moe_experts")


def known_names() -> list[str]:
    """Registered schedules first (registry order), then torch-paired names not registered yet."""
    return list(SCHEDULES) + [name for name in PAIRS if name not in SCHEDULES]


def is_sliced_family(name: str) -> bool:
    """Seq1F1B and SlimPipe (with or without interleaving): their generators live in
    ``generators/sliced.py``; at one slice they would only repeat their base schedule."""
    return SCHEDULES[name].build.__module__.rsplit(".", 1)[-1] == "sliced"


def ordered_names(names: list[str], against: str) -> list[str]:
    """Against Megatron its two schedules' counterparts run first, always: the other rows are
    timed against the faster of them."""
    if against != "megatron":
        return names
    return list(MEGATRON_PAIRS) + [name for name in names if name not in MEGATRON_PAIRS]


def plan_row(
    name: str,
    pp: int,
    microbatches: int,
    model_size: str,
    against: str = "torch",
    slices: int = DEFAULT_SLICES,
    offload: str = "none",
    overlap: bool = False,
) -> Row:
    """Decide what runs for ``name``: our schedule if it is registered and fits the model (the
    sequence-sliced family with ``slices`` slices), lowered with its messages in the order
    ``train`` gives them (a replay at the model's FLOP costs, ``schedule/run_costs.py``); the
    baseline's counterpart if there is one (torch's own constraints are checked on the ranks).
    ``offload``: our schedule with ``--pp-offload``'s copies (``auto`` is resolved on each rank,
    from k measured on its device). ``overlap``: also our schedule paired (:func:`paired_schedule`)
    and, against Megatron, its combined 1F1B where it has one for ``name``."""
    from ..megatron.model import split_layers
    from ..megatron.model_config import ModelConfig

    config = ModelConfig(**model_fields(model_size))
    num_layers = config.num_layers

    row = Row(name=name, offload=offload)
    if against == "megatron":
        row.megatron = MEGATRON_PAIRS.get(name)
        row.torch_skip = "not run (--against megatron)"
        if row.megatron is not None:
            try:
                split_layers(num_layers, pp * row.megatron.chunks)
            except ValueError as error:
                row.megatron, row.megatron_skip = None, f"{error} (--model-size)"
    else:
        row.torch = PAIRS.get(name)
        if row.torch is None:
            row.torch_skip = "torch.distributed.pipelining has no counterpart"
    if name not in SCHEDULES:
        row.ours_skip = "not in this build's schedule registry"
        return row
    sliced = is_sliced_family(name)
    if sliced:
        slices = max(slices, SCHEDULES[name].min_slices(pp, SCHEDULES[name].default_vpp))
    try:
        schedule = generate(name, pp, microbatches, slices=slices if sliced else 1)
    except RequestError as error:
        row.ours_skip = f"{error.flag}: {error}"
        return row
    try:
        split_layers(num_layers, schedule.num_stages)
    except ValueError as error:
        row.ours_skip = f"{error} (--model-size)"
        return row
    costs = run_costs(RunShape(config.shape(), config.seq_length), schedule)
    if overlap and offload == "none":
        row.paired, row.paired_skip = paired_schedule(schedule, costs)
        if row.megatron is not None:  # its layer split fits, so does the combined one's
            row.megatron_combined = MEGATRON_COMBINED.get(name)
    schedule = lower(schedule, costs)
    hang = check_nccl(schedule, strict=False, warmed=True)  # as the runtime runs it (docs/nccl.md)
    if hang is not None:
        row.ours_skip = f"would hang under NCCL: {hang.message()}"
        row.paired, row.paired_skip = None, row.paired_skip or row.ours_skip
        return row
    if offload != "none":
        row.plain = schedule
    if offload not in ("none", "auto"):
        try:
            schedule = apply_offload(schedule, OffloadPolicy(offload))
        except OffloadError as error:
            row.ours_skip = f"{error.flag}: {error}"
            return row
    row.ours = schedule
    if sliced:
        row.notes.append(f"{schedule.slices} sequence slices")
    pair = row.torch
    if pair is not None and (
        pair.stages_per_rank != schedule.vpp or pair.placement != schedule.placement.style
    ):
        row.notes.append(
            f"placement differs: ours v={schedule.vpp} {schedule.placement.style}, "
            f"torch v={pair.stages_per_rank} {pair.placement}"
        )
    return row


def paired_schedule(schedule: Schedule, costs: Any) -> tuple[Schedule | None, str | None]:
    """``schedule`` (unlowered) with its overlapped F&B pairs, lowered at ``costs``, as ``train
    --overlap-moe-expert-parallel-comm`` pairs and lowers it (``megatron/hook.py``), or why not."""
    from ..schedule.pairing import pair

    if schedule.slices > 1:
        return None, f"not paired: sequence slices ({schedule.slices}) do not run with pairs"
    paired = lower(pair(schedule, costs), costs)
    hang = check_nccl(paired, strict=False, warmed=True)
    if hang is not None:
        return None, f"paired, would hang under NCCL: {hang.message()}"
    return paired, None


def fine_grained(pair: MegatronPair, modules: tuple[str, ...], min_bytes: int) -> MegatronPair:
    """``pair`` with megatron-core's fine-grained activation offloading of ``modules``."""
    return MegatronPair(
        pair.function,
        pair.chunks,
        f"{pair.label} + fine-grained offload ({','.join(modules)})",
        tuple(modules),
        min_bytes,
    )
