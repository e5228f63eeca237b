"""Megatron layouts of a GPU count: (TP, CP, PP, DP), which links each group uses, and which
layouts Megatron would refuse for a model and sequence.

Ranks are numbered as Megatron-LM numbers them by default (``tp-cp-ep-dp-pp``: tensor-parallel
ranks adjacent, then context, data and pipeline), and nodes hold ``gpus_per_node`` consecutive
ranks. A group is inside one node when its ranks span at most one node's worth of consecutive
ranks; otherwise its collectives cross InfiniBand.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..schedule.layer_split import uneven_splits
from ..schedule.memory_model import Parallelism, tp_indivisible
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
        )

    def label(self) -> str:
        text = f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"
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


def layouts(gpus: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every factorisation of ``gpus`` into TP x CP x PP x DP."""
    for t in divisors(gpus):
        for c in divisors(gpus // t):
            for p in divisors(gpus // (t * c)):
                yield Layout(t, c, p, gpus // (t * c * p), gpus_per_node)
