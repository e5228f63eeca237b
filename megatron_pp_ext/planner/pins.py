"""Pins: the parts of a layout the user fixed, with Megatron's flag names (and the plugin's
``--pp-*``); the search varies only the rest.

A pin that no layout can meet (TP not dividing the heads, a product that does not divide the GPU
count, chunks that do not split the layers, a micro-batch size that does not divide the global
batch or, with TP, CP and PP all pinned, one DP rank's share of it) is refused by
:meth:`Pins.check` before the search, in one line that names the flag; one that divides but does
not fit memory is reported by the search's rejections (``plan``) or by the prediction itself
(``plan --from-args``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ..schedule.generators import SCHEDULES
from ..schedule.layer_split import uneven_splits
from ..schedule.memory_model import tp_indivisible
from ..schedule.models import ModelShape
from .layout import Layout, layouts

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
OFFLOADS = ("none", "auto", "full", "selective")
VOCABS = ("none", "vocab-1", "vocab-2")
# Candidate fields that are the run's software, not layout choices: a free search over the same
# run keeps them as given (``Pins.environment``).
ENVIRONMENT = (
    "tp_comm_overlap",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_reduce_in_fp32",
    "grad_reduce_buckets",
    "attention",
)
SLICED_FAMILIES = ("seq1f1b", "seq1f1b-interleaved", "slimpipe", "slimpipe-interleaved")


class PinError(ValueError):
    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class Pins:
    """None: searched. ``flags`` remembers which flag set what, for messages."""

    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    ep: int | None = None  # --expert-model-parallel-size (a mixture-of-experts model's)
    etp: int | None = None  # --expert-tensor-parallel-size
    vpp: int | None = None  # --num-virtual-stages-per-pipeline-rank (or --pp-chunks)
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    sequence_parallel: bool | None = None
    distributed_optimizer: bool | None = None
    recompute: str | None = None
    recompute_layers: int | None = None  # --recompute-method block --recompute-num-layers N
    schedule: str | None = None
    slices: int | None = None
    offload: str | None = None
    vocab: str | None = None  # --pp-vocab-parallel
    micro_batch: int | None = None  # --micro-batch-size
    pairs: bool | None = None  # --overlap-moe-expert-parallel-comm (None: searched for MoE)
    # the run's software, not layout choices: the search keeps them as given
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_reduce_in_fp32: bool = False
    grad_reduce_buckets: bool = False  # Megatron's own schedules (see step.Candidate)
    attention: str = "flash"  # "unfused": Megatron's score-matrix attention (see costs.py)
    even_layers: bool = True  # False: stages may differ by a layer (Llama 3's published split)
    # the run's own layers per pipeline stage (--decoder-first/last-pipeline-num-layers); None: even
    stage_layers: tuple[int, ...] | None = None
    flags: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in (
            "tp", "cp", "pp", "ep", "etp", "vpp", "layers_per_virtual_stage", "slices", "recompute_layers",
            "micro_batch",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PinError(self.flag(name), f"{self.flag(name)} must be at least 1, got {value}")
        if self.recompute not in (None, *RECOMPUTE_GRANULARITIES):
            raise PinError("--recompute-granularity", f"choose full or selective, got {self.recompute!r}")
        if self.offload not in (None, *OFFLOADS):
            raise PinError("--pp-offload", f"choose from {', '.join(OFFLOADS)}, got {self.offload!r}")
        if self.vocab not in (None, *VOCABS):
            raise PinError("--pp-vocab-parallel", f"choose from {', '.join(VOCABS)}, got {self.vocab!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PinError(
                "--pp-schedule", f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}"
            )

    def flag(self, name: str) -> str:
        default = {
            "tp": "--tensor-model-parallel-size",
            "cp": "--context-parallel-size",
            "pp": "--pipeline-model-parallel-size",
            "ep": "--expert-model-parallel-size",
            "etp": "--expert-tensor-parallel-size",
            "vpp": "--num-virtual-stages-per-pipeline-rank",
            "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
            "sequence_parallel": "--sequence-parallel",
            "distributed_optimizer": "--use-distributed-optimizer",
            "recompute": "--recompute-granularity",
            "recompute_layers": "--recompute-num-layers",
            "schedule": "--pp-schedule",
            "slices": "--pp-seq-slices",
            "offload": "--pp-offload",
            "vocab": "--pp-vocab-parallel",
            "micro_batch": "--micro-batch-size",
            "pairs": "--overlap-moe-expert-parallel-comm",
        }[name]
        return self.flags.get(name, default)

    @property
    def pinned(self) -> list[str]:
        """The flags that pin something (for the title of the answer)."""
        names = ("tp", "cp", "pp", "ep", "etp", "vpp", "layers_per_virtual_stage", "schedule", "slices")
        names += ("micro_batch",)
        names += ("sequence_parallel", "distributed_optimizer", "recompute", "offload", "vocab", "pairs")
        return [self.flag(n) for n in names if getattr(self, n) is not None]

    # ---- before the search ---------------------------------------------------------------------

    def check(
        self, shape: ModelShape, gpus: int, gpus_per_node: int, global_batch: int | None = None
    ) -> None:
        """Refuse a pin that no layout of ``gpus`` can meet (PinError naming the flag); the
        micro-batch pin against ``global_batch`` when given."""
        if self.tp is not None:
            indivisible = tp_indivisible(shape, self.tp)
            if indivisible:
                raise PinError(
                    self.flag("tp"), f"{self.flag('tp')} {self.tp} does not divide the {indivisible}"
                )
            if self.tp > gpus_per_node:
                raise PinError(
                    self.flag("tp"),
                    f"{self.flag('tp')} {self.tp} is wider than a node of {gpus_per_node} GPUs",
                )
        for name in ("ep", "etp"):
            size = getattr(self, name)
            if size is not None and not shape.experts and (name == "etp" or size != 1):
                raise PinError(self.flag(name), f"{self.flag(name)} needs a mixture-of-experts model")
        if self.ep is not None and shape.experts and shape.experts % self.ep:
            raise PinError(
                self.flag("ep"), f"{self.flag('ep')} {self.ep} does not divide the {shape.experts} experts"
            )
        fixed = [(n, getattr(self, n)) for n in ("tp", "cp", "pp") if getattr(self, n) is not None]
        product = 1
        for _, size in fixed:
            product *= size
        if gpus % product:
            sizes = " x ".join(f"{self.flag(n)} {v}" for n, v in fixed)
            sizes += f" = {product}" if len(fixed) > 1 else ""
            raise PinError(self.flag(fixed[-1][0]), f"{sizes} does not divide --gpus {gpus}")
        if (
            self.pp is not None
            and shape.layers % self.pp
            and self.even_layers
            and not uneven_splits(shape.layers, self.pp)
        ):
            raise PinError(
                self.flag("pp"), f"{self.flag('pp')} {self.pp} does not divide the {shape.layers} layers"
            )
        if self.sequence_parallel and self.tp == 1:
            raise PinError(
                self.flag("sequence_parallel"), "--sequence-parallel needs --tensor-model-parallel-size > 1"
            )
        if (self.vpp or 1) > 1 or self.layers_per_virtual_stage is not None:
            if self.pp == 1:
                raise PinError(
                    self.flag("vpp"), "virtual pipeline stages need --pipeline-model-parallel-size > 1"
                )
        if self.pp is not None and self.layers_per_virtual_stage is not None:
            per_rank = shape.layers // self.pp
            if per_rank % self.layers_per_virtual_stage:
                raise PinError(
                    self.flag("layers_per_virtual_stage"),
                    f"{self.flag('layers_per_virtual_stage')} {self.layers_per_virtual_stage} "
                    "does not divide "
                    f"the {per_rank} layers of a pipeline rank",
                )
        if (
            self.pp is not None
            and self.vpp is not None
            and shape.layers % (self.pp * self.vpp)
            and self.even_layers
            and not uneven_splits(shape.layers, self.pp, self.vpp)
        ):
            raise PinError(
                self.flag("vpp"),
                f"{self.flag('pp')} {self.pp} x {self.flag('vpp')} {self.vpp} does not divide the "
                f"{shape.layers} layers",
            )
        if self.schedule is not None:
            spec = SCHEDULES[self.schedule]
            vpp = self.vpp
            if vpp is not None and spec.allowed_vpp is not None and vpp not in spec.allowed_vpp:
                raise PinError(
                    self.flag("vpp"), f"{self.schedule} runs {spec.allowed_vpp} chunk(s) per rank, not {vpp}"
                )
            if vpp is not None and vpp > 1 and spec.allowed_vpp is None and vpp < max(2, spec.min_vpp):
                raise PinError(
                    self.flag("vpp"), f"{self.schedule} needs at least {max(2, spec.min_vpp)} chunks per rank"
                )
        if self.slices is not None and self.slices > 1 and self.schedule is not None:
            if self.schedule not in SLICED_FAMILIES:
                raise PinError(
                    self.flag("slices"),
                    f"{self.schedule} runs whole sequences; slices need one of {', '.join(SLICED_FAMILIES)}",
                )
        if self.pairs and not shape.experts:
            raise PinError(
                self.flag("pairs"),
                f"{self.flag('pairs')} overlaps the expert all-to-all: {shape.name} has no experts",
            )
        if self.recompute_layers is not None and self.recompute != "full":
            raise PinError(
                self.flag("recompute_layers"), "--recompute-num-layers needs --recompute-granularity full"
            )
        if global_batch is not None:
            self.check_micro_batch(gpus, global_batch)

    def check_micro_batch(self, gpus: int, global_batch: int) -> None:
        """The micro-batch pin must divide the global batch, and, when TP, CP and PP are all pinned
        (so DP is too), one DP rank's share of it: Megatron refuses the run otherwise."""
        size = self.micro_batch
        if size is None:
            return
        flag = self.flag("micro_batch")
        if global_batch % size:
            raise PinError(
                flag, f"{flag} {size} does not divide the global batch of {global_batch} sequences"
            )
        if None in (self.tp, self.cp, self.pp):
            return
        dp = gpus // (self.tp * self.cp * self.pp)  # type: ignore[operator]
        if global_batch % dp == 0 and (global_batch // dp) % size:
            raise PinError(
                flag,
                f"{flag} {size} does not divide the {global_batch // dp} sequences of a DP rank "
                f"(global batch {global_batch} over DP {dp})",
            )

    # ---- in the search ---------------------------------------------------------------------------

    def layouts(self, gpus: int, gpus_per_node: int, shape: ModelShape | None = None) -> Iterator[Layout]:
        """The layouts of ``gpus`` that meet the TP/CP/PP pins, with the SP and optimizer pins;
        with a mixture-of-experts ``shape`` also its expert layouts that meet the EP/ETP pins
        (:func:`layout.expert_layouts`)."""
        for layout in layouts(gpus, gpus_per_node, shape):
            if any(getattr(self, n) not in (None, getattr(layout, n)) for n in ("tp", "cp", "pp", "ep")):
                continue
            if self.etp not in (None, layout.expert_tp):
                continue
            yield replace(
                layout,
                sequence_parallel=True if self.sequence_parallel is None else self.sequence_parallel,
                distributed_optimizer=True
                if self.distributed_optimizer is None
                else self.distributed_optimizer,
            )

    def schedules(self, names: list[str]) -> list[str]:
        return [n for n in names if self.schedule in (None, n)]

    def chunks_allowed(self, layers: int, pp: int, vpp: int) -> bool:
        if self.layers_per_virtual_stage is not None:
            return layers == pp * vpp * self.layers_per_virtual_stage
        return self.vpp in (None, vpp)

    def slices_allowed(self, slices: int) -> bool:
        return self.slices in (None, slices)

    def pairs_allowed(self, pairs: bool) -> bool:
        return self.pairs in (None, pairs)

    def environment(self) -> Pins:
        """Only the run's software settings: what a free search over the same run keeps."""
        return Pins(**{name: getattr(self, name) for name in ENVIRONMENT})

    def candidate_options(self) -> dict:
        """Candidate fields the pins fix (offload and recompute only when pinned)."""
        options: dict = {name: getattr(self, name) for name in ENVIRONMENT}
        if self.offload is not None:
            options["offload"] = self.offload
        if self.recompute is not None:
            options["recompute"] = self.recompute
            options["recompute_layers"] = self.recompute_layers
        if self.vocab is not None:
            options["vocab"] = self.vocab
        return options

    @property
    def fixes_memory_savers(self) -> bool:
        """Whether offload and recomputation are both pinned (the search may not add them)."""
        return self.offload is not None and self.recompute is not None
