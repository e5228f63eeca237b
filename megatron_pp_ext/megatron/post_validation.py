"""Optimizer post-validation (Zero Bubble, section 4): step first, check the global state after.

A synchronous optimizer step waits for the global gradient norm and the NaN/inf check, an
all-reduce over every pipeline stage, so a stage whose backward ends early idles until the last
one is done: the bubble Zero Bubble schedules keep at every iteration boundary. Post-validation
replaces that wait:

1. every stage computes its local state (sum of squared gradients; a NaN or inf makes it
   non-finite) and starts the global all-reduce without waiting for it;
2. the *partial* state travels down the pipeline, from the last rank (whose backward ends first
   under 1F1B, ZB and V-shape schedules) to rank 0, each rank adding its own: rank r knows the
   state of ranks r..p-1, a lower bound of the global one;
3. if the partial state already shows a NaN/inf or a norm above the clip threshold, the rank
   waits for the global state (it must skip or clip); otherwise it steps at once, optimistically,
   keeping a copy of what the step overwrites (parameters and optimizer state);
4. when the global state arrives: if it is non-finite or needs clipping, the optimistic step is
   rolled back (the copy restored, bit for bit) and redone exactly as the synchronous optimizer
   does it (skipped, or clipped with the same global norm).

The global norm is the synchronous optimizer's own all-reduce of the same local sums, so every
decision and every clip factor is bitwise the synchronous one: the result is identical, rolled
back or not. The rollback copy costs one copy of the parameters and of the optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class PendingState:
    """A step's gradient state: the partial one (this rank and the ranks after it in the
    pipeline) at once, the global one once its all-reduce completes (:meth:`wait`)."""

    partial: float  # sum of squares over pipeline ranks r..p-1 of this pipeline (inf/nan if any)
    total: torch.Tensor
    work: Any

    def wait(self) -> float:
        """The global gradient norm, computed as the synchronous optimizer computes it."""
        if self.work is not None:
            self.work.wait()
        return float(self.total.sqrt())


class PostValidation:
    """The partial reduction down one pipeline and the global all-reduce over the model-parallel
    group (the synchronous optimizer's), started together."""

    def __init__(self, pipeline_group: Any = None, model_parallel_group: Any = None) -> None:
        from megatron.core import parallel_state

        self.pipeline_group = pipeline_group or parallel_state.get_pipeline_model_parallel_group()
        self.model_parallel_group = model_parallel_group or parallel_state.get_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.pipeline_group)
        self.index = self.ranks.index(dist.get_rank())

    def begin(self, local: torch.Tensor) -> PendingState:
        """Start the global all-reduce of ``local`` (a float64 scalar), then pass the partial
        state from the pipeline's last rank towards rank 0."""
        from ..runtime.p2p import PeerError

        total = local.clone()
        work = dist.all_reduce(total, group=self.model_parallel_group, async_op=True)
        partial = local.clone()
        peer = self.index + 1
        try:
            if peer < len(self.ranks):
                received = torch.empty_like(partial)
                dist.recv(received, src=self.ranks[peer], group=self.pipeline_group)
                partial += received
            peer = self.index - 1
            if peer >= 0:
                dist.send(partial, dst=self.ranks[peer], group=self.pipeline_group)
        except RuntimeError as error:  # a peer died or hangs: name it, as the p2p layer does
            first = (str(error).splitlines() or [""])[0]
            raise PeerError(
                f"rank {self.index}: post-validation partial state with rank {peer} failed: {first}"
            ) from error
        return PendingState(float(partial), total, work)


class Snapshot:
    """What an optimizer step overwrites: parameters and their optimizer state, copied so a
    rollback restores them bit for bit (state the step creates is removed again)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        with torch.no_grad():
            self.values = [param.detach().clone() for param in self.params]
        self.states = [
            {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
            if (state := optimizer.state.get(param))
            else None
            for param in self.params
        ]

    @torch.no_grad()
    def restore(self) -> None:
        for param, value, saved in zip(self.params, self.values, self.states):
            param.copy_(value)
            if saved is None:
                self.optimizer.state.pop(param, None)
                continue
            state = self.optimizer.state[param]
            for key, old in saved.items():
                if torch.is_tensor(old) and torch.is_tensor(state.get(key)):
                    state[key].copy_(old)
                else:
                    state[key] = old
