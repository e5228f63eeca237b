"""Megatron layouts of a GPU count: (TP, CP, PP, DP), which links each group uses, and which
layouts Megatron would refuse for a model and sequence.

Ranks are numbered as Megatron-LM numbers them by default (``tp-cp-ep-dp-pp``: tensor-parallel
ranks adjacent, then context, data and pipeline), and nodes hold ``gpus_per_node`` consecutive
ranks. A group is inside one node when its ranks span at most one node's worth of consecutive
ranks; otherwise its collectives cross InfiniBand.

Mixture-of-experts layers lay the same ranks out again (megatron-core's "MoE parallel folding",
``parallel_state.initialize_model_parallel``): a second ``RankGenerator`` with ``tp=ETP, ep=EP,
dp=EDP, pp=PP, cp=1`` and the same order ``tp-cp-ep-dp-pp``, over the same world, where
EDP = world / (ETP x EP x PP) (megatron-core raises unless ETP x EP x PP divides the world, i.e.
EP x ETP divides a stage's TP x CP x DP ranks) and both generators' pipeline groups must match.
So the expert-TP ranks are adjacent and an EP group's ranks are strided by ETP: EP x ETP
consecutive ranks of one pipeline stage (CP is folded into EP / EDP, not between them). ETP
defaults to the TP size (``--expert-tensor-parallel-size``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..schedule.layer_split import uneven_splits
from ..schedule.memory_model import ParallelError, Parallelism, check_experts, tp_indivisible
from ..schedule.models import ModelShape


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    gpus_per_node: int = 8
    sequence_parallel: bool = True  # with TP > 1 (``--sequence-parallel``)
    distributed_optimizer: bool = True  # with DP x CP > 1 (``--use-distributed-optimizer``)
    ep: int = 1  # expert parallel (``--expert-model-parallel-size``)
    etp: int | None = None  # expert TP (``--expert-tensor-parallel-size``); None: the TP size

    def __post_init__(self) -> None:
        """Refuse expert sizes megatron-core's ``initialize_model_parallel`` refuses, whatever the
        model: EP x ETP x PP must divide the world (EP x ETP a stage's TP x CP x DP ranks)."""
        if self.ep < 1 or self.expert_tp < 1:
            raise ValueError(f"EP {self.ep} and ETP {self.expert_tp} must be at least 1")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.expert_tp):
            raise ValueError(
                f"EP{self.ep} x ETP{self.expert_tp} does not divide the {stage} ranks of a pipeline "
                f"stage (TP{self.tp} x CP{self.cp} x DP{self.dp})"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def _inside(self, span: int) -> bool:
        return span <= self.gpus_per_node

    @property
    def tp_intra(self) -> bool:
        return self._inside(self.tp)

    @property
    def cp_intra(self) -> bool:
        return self._inside(self.tp * self.cp)

    @property
    def dp_intra(self) -> bool:
        """The data-parallel (x context-parallel) group that reduces gradients."""
        return self._inside(self.tp * self.cp * self.dp)

    @property
    def ep_intra(self) -> bool:
        """The expert-parallel group (its all-to-alls) inside one node. Under the expert order
        ``tp-cp-ep-dp-pp`` with ``tp=ETP, cp=1`` an EP group is EP ranks strided by ETP, so it
        spans ETP x EP consecutive ranks (starting at a multiple of them)."""
        return self._inside(self.expert_tp * self.ep)

    @property
    def etp_intra(self) -> bool:
        """The expert-TP group (adjacent ranks) inside one node."""
        return self._inside(self.expert_tp)

    @property
    def pp_intra(self) -> bool:
        return self._inside(self.gpus)

    @property
    def parallel(self) -> Parallelism:
        """Megatron's sizes for the memory model. The search's layouts use sequence parallelism
        whenever TP > 1 (it cuts the replicated activations at no extra communication) and the
        distributed optimizer whenever the state can be sharded; a pinned run may turn either off."""
        return Parallelism(
            tp=self.tp,
            sp=self.tp > 1 and self.sequence_parallel,
            cp=self.cp,
            dp=self.dp,
            distributed_optimizer=self.dp * self.cp > 1 and self.distributed_optimizer,
            ep=self.ep,
            etp=self.etp,
        )

    def label(self) -> str:
        text = f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"
        if self.ep > 1:
            text += f" EP{self.ep}"
        if self.expert_tp != self.tp:
            text += f" ETP{self.expert_tp}"
        if self.tp > 1 and not self.sequence_parallel:
            text += " no-SP"
        if self.dp * self.cp > 1 and not self.distributed_optimizer:
            text += " no-distopt"
        return text


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(
    layout: Layout, shape: ModelShape, seq_length: int, global_batch: int, micro_batch: int
) -> tuple[str, str] | None:
    """Why Megatron (or the plugin) would refuse ``layout``, as (reason, detail); None if valid."""
    t, p, d = layout.tp, layout.pp, layout.dp
    indivisible = tp_indivisible(shape, t)
    if indivisible:
        return "indivisible: TP", f"TP{t} does not divide the {indivisible}"
    try:
        check_experts(shape, layout.parallel)  # EP divides the experts, ETP their width; MoE + TP: SP
    except ParallelError as error:
        return "expert layout", str(error)
    if t > layout.gpus_per_node:
        return "TP across nodes", f"TP{t} is wider than a node of {layout.gpus_per_node} GPUs"
    multiple = layout.parallel.sequence_multiple
    if seq_length % multiple:
        return "indivisible: sequence", f"{seq_length} tokens are not a multiple of {multiple} (TP x 2CP)"
    if shape.layers % p and not uneven_splits(shape.layers, p):
        return (
            "indivisible: layers",
            f"PP{p} does not divide {shape.layers} layers, nor does a Megatron split",
        )
    if global_batch % (d * micro_batch):
        return (
            "indivisible: batch",
            f"global batch {global_batch} is not a multiple of DP{d} x micro-batch {micro_batch}",
        )
    return None


def expert_layouts(layout: Layout, shape: ModelShape) -> Iterator[Layout]:
    """``layout`` (EP 1, ETP = TP) and then, for a mixture-of-experts ``shape``, every EP that
    divides the experts and the stage's TP x CP x DP ranks, with ETP = TP and, where it differs,
    ETP = 1 (megatron-core's common "MoE parallel folding" choice), EP 1 first; the expert
    variants megatron-core would refuse (``check_experts``: ETP not dividing the experts' width,
    EP x ETP not dividing the stage's ranks) are skipped. A dense shape yields ``layout`` alone."""
    yield layout
    if not shape.experts:
        return
    stage = layout.tp * layout.cp * layout.dp
    for ep in divisors(stage):
        if shape.experts % ep:
            continue
        for etp in (None, 1) if layout.tp > 1 else (None,):
            if (ep, etp) == (1, None) or stage % (ep * (layout.tp if etp is None else etp)):
                continue
            variant = replace(layout, ep=ep, etp=etp)
            try:
                check_experts(shape, variant.parallel)
            except ParallelError:
                continue
            yield variant


def layouts(gpus: int, gpus_per_node: int, shape: ModelShape | None = None) -> Iterator[Layout]:
    """Every factorisation of ``gpus`` into TP x CP x PP x DP; with a mixture-of-experts
    ``shape``, each followed by its expert layouts (:func:`expert_layouts`)."""
    for t in divisors(gpus):
        for c in divisors(gpus // t):
            for p in divisors(gpus // (t * c)):
                layout = Layout(t, c, p, gpus // (t * c * p), gpus_per_node)
                if shape is None:
                    yield layout
                else:
                    yield from expert_layouts(layout, shape)
