"""The costs a run's ranks agree on: what places the vocabulary passes and orders the messages.

Two steps of resolving a schedule replay it with a cost model: ``vocab.add_vocab_passes`` places
each S and T pass where the replay finds the rank idle, and ``message_order.order_messages`` puts
the step's messages in the order the replay sends them. Every rank must derive the same schedule,
so the costs must be ones every rank can compute alike. Unit costs are such costs, and they are
what a schedule without a model gets; but they are wrong where the ops are not alike: a
vocabulary pass of Gemma-2 9B (V = 256000) costs far more than a unit, and the order and places
worked out at unit costs then make the simulated step up to 20% longer (docs/vocab_parallel.md).

Every rank knows the model's shape and the sequence length, so it can compute the FLOP model's
durations (``flops.py``), bit for bit the same on every rank. They count a whole layer's FLOPs
(TP, SP and CP do not change them) for one sequence (the micro-batch size scales them all alike,
so one sequence gives the same order). What no rank knows alike is the link speed, so
messages are taken as instant: the order depends on the FLOPs only. Activation copies are added
to the lowered schedule (``lowering.insert_offload`` keeps its order), so they play no part. The
runtime (the Megatron hook) resolves its schedules with these costs, and ``simulate --model`` and
``plan`` resolve theirs the same way, so they predict the order the run follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import FlopCosts, flop_costs_for
from .ir import Schedule
from .memory_model import stage_layers
from .models import ModelShape


@dataclass(frozen=True)
class RunShape:
    """What the FLOP durations of a run depend on, known alike to all its ranks."""

    shape: ModelShape
    seq_length: int
    # layers per virtual stage where the run splits them itself (the planner's pinned splits);
    # None: as the runtime splits them (``stage_layers``)
    layers_per_stage: tuple[int, ...] | None = None


def run_costs(run: RunShape, schedule: Schedule, vocab_parallel: str | None = None) -> FlopCosts:
    """The FLOP costs of ``schedule``'s ops in ``run``, messages instant, layers split as the run
    splits them and the sequence cut as the runtime cuts it. ``vocab_parallel`` (default:
    the schedule's own passes) takes the output layer off the last stage into S and T."""
    return flop_costs_for(
        run.shape,
        schedule,
        seq_length=run.seq_length,
        partition=schedule.meta.get("partition", "uniform"),
        layers_per_stage=list(run.layers_per_stage or stage_layers(run.shape.layers, schedule.num_stages)),
        vocab_parallel=vocab_parallel or schedule.vocab_parallel,
        p2p_bandwidth=float("inf"),
        p2p_latency=0.0,
    )
