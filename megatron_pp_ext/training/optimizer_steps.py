"""The optimizer side of the loop: one object that steps the optimizer and knows when a step is
checked, so the loop never asks whether post-validation is on.

:class:`OptimizerSteps` is the synchronous step: gradients zeroed before the pipeline step, every
rank starting at a barrier, each step checked (global norm, NaN/inf) when it returns.
:class:`PostValidatedSteps` is Zero Bubble's post-validation (``megatron/post_validation.py``):
a step is checked only at the next step's validation gate (the runtime calls :meth:`gate`), so
its row waits for that (:meth:`ready`, :meth:`release`); a validation, a checkpoint and the run's
end take the checked step (:meth:`settle`); and the order the partial state visits the pipeline
ranks is timed over the first iterations (:meth:`timed`). Same interface, same call sites.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .. import launch
from ..megatron.ddp import zero_grad_buffers
from ..megatron.optimizer import OptimizerSettings, StepInfo, build_optimizer, optimizer_step
from ..schedule.iterations import completion_order

if TYPE_CHECKING:  # for annotations only: no import edge, a shorter import chain
    from .settings import TrainSettings

Row = dict[str, Any]

# Post-validation: iterations timed from a barrier to measure the ranks' completion order.
CHAIN_ITERATIONS = 3


class OptimizerSteps:
    """Synchronous optimizer steps: each one checked (global norm, NaN/inf) when it returns."""

    def __init__(self, optimizer: Any, model: Sequence[Any]) -> None:
        self.optimizer, self.model = optimizer, model
        self.last: StepInfo | None = None

    def install(self, hook: Any) -> None:
        """Give the runtime what it calls inside a step (nothing: no gate)."""

    def begin(self, iteration: int) -> bool:
        """Before an iteration's pipeline step: zero the gradients; True when every rank starts
        the iteration at a barrier (comparable step times)."""
        zero_grad_buffers(self.model)
        return True

    def timed(self, seconds: float) -> str | None:
        """The time from the iteration's start to the end of its pipeline step; a line to show
        when it changes how the optimizer steps (never, here)."""
        return None

    def step(self, learning_rate: float) -> StepInfo:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.last = optimizer_step(self.optimizer, self.model)
        return self.last

    def settle(self) -> StepInfo:
        """The last step, checked: what a validation, a checkpoint or the run's end sees."""
        assert self.last is not None
        return self.last

    def ready(self, row: Row, step: StepInfo, settle_now: bool) -> StepInfo | None:
        """The checked step to complete ``row`` with now, or None: the row waits for its step's
        check (:meth:`release` hands it back). ``settle_now``: it cannot wait."""
        return step

    def release(self) -> tuple[Row, StepInfo] | None:
        """A row that waited, with its step now checked (at this step's gate), or None."""
        return None


class PostValidatedSteps(OptimizerSteps):
    """Post-validated steps: each rank steps on the partial gradient state of the ranks before it
    in the chain; the global check comes at the next step's gate, which rolls a failed step back
    and redoes it (then the step restarts: its forwards ran on rolled-back weights)."""

    def __init__(
        self, optimizer: Any, model: Sequence[Any], device: torch.device, unit_chain: list[int], measure: bool
    ) -> None:
        super().__init__(optimizer, model)
        self.device = device
        self.unit_chain = unit_chain  # the schedule's completion order at unit costs
        self.measure = measure  # --pp-post-validation-chain measured: time the first iterations
        self.first: int | None = None
        self.timing = False
        self.timings: list[float] = []  # this rank's iteration times, for the chain
        self.held: Row | None = None  # the last row, until its step's global check is in

    def install(self, hook: Any) -> None:
        hook.gate = self.gate
        # the global check launches in the pipeline's order once the runtime has one (NCCL's rule 3)
        self.optimizer.validation.launch_queue = lambda: hook.comm.launch if hook.comm else None

    def gate(self) -> bool:
        """At the validation gate of a step: settle the previous optimizer step (its global check;
        a failed one is rolled back and redone), then zero the gradients it used. False: the step
        restarts (its forwards ran with rolled-back weights)."""
        kept = self.optimizer.settle()
        zero_grad_buffers(self.model)
        return kept

    def begin(self, iteration: int) -> bool:
        # the runtime zeroes the gradients at the gate; no barrier once the chain is measured, or
        # the boundary bubble comes back
        if self.first is None:
            self.first = iteration
        self.timing = self.measure and iteration < self.first + CHAIN_ITERATIONS
        return self.timing

    def timed(self, seconds: float) -> str | None:
        if not self.timing:
            return None
        self.timings.append(seconds)
        return self._set_chain() if len(self.timings) == CHAIN_ITERATIONS else None

    def _set_chain(self) -> str:
        """Pass the partial gradient state in the order the ranks of this pipeline finish their
        part of an iteration, as measured (from a barrier) over the first iterations but the very
        first. The schedule's order at unit costs can be wrong on a real machine: under ZB-H2
        rank 0 ends first only while B + p2p < 2 W. Returns the line that says the chain."""
        group = parallel_state.get_pipeline_model_parallel_group()
        timed = self.timings[1:] or self.timings  # the first iteration warms up (allocations, groups)
        device = launch.collective_device(self.device)
        mine = torch.tensor([sum(timed) / len(timed)], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        times = [float(item) for item in gathered]
        chain = sorted(reversed(range(len(times))), key=lambda rank: times[rank])  # ties: higher first
        self.optimizer.validation.set_chain(chain)
        return (
            "post-validation: partial state along "
            + " > ".join(f"rank {rank} ({times[rank] * 1e3:.0f} ms)" for rank in chain)
            + f" (schedule's order at unit costs: {' > '.join(map(str, self.unit_chain))})"
        )

    def settle(self) -> StepInfo:
        if not self.optimizer.last.settled:
            self.optimizer.settle()
        return self.optimizer.last

    def ready(self, row: Row, step: StepInfo, settle_now: bool) -> StepInfo | None:
        if step.settled:
            return step
        if settle_now:
            return self.settle()
        self.held = row
        return None

    def release(self) -> tuple[Row, StepInfo] | None:
        if self.held is None:
            return None
        row, self.held = self.held, None
        return row, self.optimizer.last


def first_chain(name: str, unit_chain: list[int]) -> list[int]:
    """The first chain of ``--pp-post-validation-chain`` (measured: the schedule's until timed)."""
    pp = len(unit_chain)
    return {"up": list(range(pp)), "down": list(reversed(range(pp)))}.get(name, unit_chain)


def build_optimizer_steps(
    model: Sequence[Any], settings: TrainSettings, schedule: Any, bf16: bool, device: torch.device
) -> OptimizerSteps:
    """The optimizer (Megatron's on GPU, ours on CPU or under post-validation) and how it steps."""
    optimizer_settings = OptimizerSettings(
        lr=settings.lr, weight_decay=settings.weight_decay, clip_grad=settings.clip_grad
    )
    if not settings.post_validation:
        return OptimizerSteps(
            build_optimizer(model, optimizer_settings, bf16=bf16, kind=settings.optimizer), model
        )
    # post-validation's chain until the first iterations measured the order (_set_chain)
    unit_chain = completion_order(schedule)
    optimizer = build_optimizer(
        model,
        optimizer_settings,
        bf16=bf16,
        post_validation=True,
        # the partial gradient state goes from rank to rank in the order they finish
        chain=first_chain(settings.post_validation_chain, unit_chain),
    )
    return PostValidatedSteps(
        optimizer, model, device, unit_chain, measure=settings.post_validation_chain == "measured"
    )
