"""Optimizer post-validation (Zero Bubble, section 4): step first, check the global state after.

A synchronous optimizer step waits for the global gradient norm and the NaN/inf check, an
all-reduce over every pipeline stage, so a stage whose backward ends early idles until the last
one is done: the bubble Zero Bubble schedules keep at every iteration boundary. Post-validation
replaces that wait:

1. every stage computes its local state (sum of squared gradients; a NaN or inf makes it
   non-finite) and starts the global all-reduce without waiting for it;
2. the *partial* state travels along the pipeline in the order the ranks finish their iteration
   (the ``chain``: ``train`` times the first iterations, and starts from the schedule's order
   at unit costs, ``schedule.iterations.completion_order``: rank 0 first under ZB-H2 and V-ZB,
   the last rank first under 1F1B; :meth:`PostValidation.set_chain`), each rank adding its own: a rank
   knows the state of itself and the ranks before it, a lower bound of the global one. The hop
   to the next rank is sent without waiting for it to be taken;
3. if the partial state already shows a NaN/inf or a norm above the clip threshold, the rank
   waits for the global state (it must skip or clip); otherwise it steps at once, optimistically,
   keeping a copy of what the step overwrites (parameters and optimizer state), and goes on
   with its next iteration;
4. when the global state arrives (the next iteration waits for it at its *gate*, before its
   first backward-side op, ``schedule/gate.py``): if it is non-finite or needs clipping, the
   optimistic step is rolled back (the copy restored, bit for bit) and redone exactly as the
   synchronous optimizer does it (skipped, or clipped with the same global norm), and the
   forwards already run with the rolled-back weights are run again.

The global norm is the synchronous optimizer's own all-reduce of the same local sums, so every
decision and every clip factor is bitwise the synchronous one: the result is identical, rolled
back or not. The rollback copy costs one copy of the parameters and of the optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class PendingState:
    """A step's gradient state: the partial one (this rank and the ranks before it in the
    chain) at once, the global one once its all-reduce completes (:meth:`wait`)."""

    partial: float  # sum of squares over this rank and the ranks before it in the chain (inf/nan if any)
    total: torch.Tensor
    work: Any
    rank: int  # this pipeline rank, for errors
    group_ranks: Sequence[int] = ()  # the processes of the global all-reduce, for errors
    next_rank: int | None = None  # where ``hop`` sends the partial state
    hop: Any = None  # the partial state's send to the next rank in the chain
    hop_buffer: torch.Tensor | None = None  # what ``hop`` sends, alive until it is out

    def wait(self) -> float:
        """The global gradient norm, computed as the synchronous optimizer computes it. A peer
        that died or hangs makes it raise a PeerError naming this rank and what it waited for."""
        if self.hop is not None:
            with _named(f"rank {self.rank}: post-validation partial state to rank {self.next_rank}"):
                self.hop.wait()
            self.hop = self.hop_buffer = None
        if self.work is not None:
            group = f"over the model-parallel group, ranks {list(self.group_ranks)}"
            with _named(f"rank {self.rank}: post-validation global gradient state (all-reduce {group})"):
                self.work.wait()
            self.work = None
        return float(self.total.sqrt())


@contextmanager
def _named(what: str) -> Iterator[None]:
    """A failed or timed-out transfer as the p2p layer reports it: a PeerError naming it."""
    from ..runtime.p2p import PeerError

    try:
        yield
    except RuntimeError as error:
        raise PeerError(f"{what} failed: {(str(error).splitlines() or [''])[0]}") from error


class PostValidation:
    """The partial reduction along one pipeline and the global all-reduce over the model-parallel
    group (the synchronous optimizer's), started together. ``chain``: the pipeline ranks in the
    order the partial state visits them (default: the last rank down to rank 0). ``device``:
    where the state lives; given, every chain set also creates its communicators at once
    (:meth:`warm_up`). :attr:`launch_queue`: where this rank's operations are launched once the
    pipeline has a queue (``runtime/launch_order.Launcher``: one launch order with the steps'
    messages, as NCCL completes a GPU's communication; the training loop sets it)."""

    def __init__(
        self,
        pipeline_group: Any = None,
        model_parallel_group: Any = None,
        chain: Sequence[int] | None = None,
        device: torch.device | None = None,
    ) -> None:
        from megatron.core import parallel_state

        self.device = device
        self.pipeline_group = pipeline_group or parallel_state.get_pipeline_model_parallel_group()
        self.model_parallel_group = model_parallel_group or parallel_state.get_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.pipeline_group)
        self.group_ranks = dist.get_process_group_ranks(self.model_parallel_group)
        self.index = self.ranks.index(dist.get_rank())
        self.launch_queue: Callable[[], Any] = lambda: None  # the Launcher, or None: launch at once
        self.set_chain(list(reversed(range(len(self.ranks)))) if chain is None else chain)

    def set_chain(self, chain: Sequence[int]) -> None:
        """Pass the partial state in this order of pipeline ranks from now on (every rank of the
        pipeline must set the same, between steps)."""
        chain = list(chain)
        if sorted(chain) != list(range(len(self.ranks))):
            raise ValueError(f"chain {chain} is not an order of the {len(self.ranks)} pipeline ranks")
        self.chain = chain
        place = chain.index(self.index)
        self.previous = chain[place - 1] if place > 0 else None
        self.next = chain[place + 1] if place + 1 < len(chain) else None
        if self.device is not None:
            self.warm_up(self.device)

    def warm_up(self, device: torch.device) -> None:
        """One zero state through the all-reduce and the chain, as a step sends it: NCCL creates a
        communicator at its first use and blocks its members there, so the pairs of a new chain
        and the all-reduce are created here, where every rank of the pipeline sets the chain
        (between steps), and no step waits on a creation."""
        self.begin(torch.zeros((), dtype=torch.float64, device=device)).wait()

    def wire_device(self, device: torch.device) -> torch.device:
        """Where the state travels: host memory under gloo (ranks sharing a GPU: gloo has no
        CUDA point-to-point path), ``device`` otherwise."""
        return torch.device("cpu") if dist.get_backend(self.pipeline_group) == "gloo" else device

    def begin(self, local: torch.Tensor) -> PendingState:
        """Start the global all-reduce of ``local`` (a float64 scalar), take the partial state
        of the ranks before this one in the chain, add ours and start sending it on."""
        local = local.to(self.wire_device(local.device))
        total = local.clone()
        work = self._launch(
            lambda: dist.all_reduce(total, group=self.model_parallel_group, async_op=True),
            f"rank {self.index}: post-validation all-reduce",
        )
        partial = local.clone()
        hop = None
        if self.previous is not None:
            received = torch.empty_like(partial)
            what = f"rank {self.index}: post-validation partial state from rank {self.previous}"
            with _named(what):
                source = self.ranks[self.previous]
                self._launch(lambda: dist.irecv(received, src=source, group=self.pipeline_group), what).wait()
            partial += received
        if self.next is not None:
            what = f"rank {self.index}: post-validation partial state to rank {self.next}"
            with _named(what):
                target = self.ranks[self.next]
                hop = self._launch(lambda: dist.isend(partial, dst=target, group=self.pipeline_group), what)
        return PendingState(
            float(partial), total, work, self.index, self.group_ranks, self.next, hop, partial
        )

    def _launch(self, start: Callable[[], Any], what: str) -> Any:
        queue = self.launch_queue()
        return start() if queue is None else queue(start, what)


class Snapshot:
    """What an optimizer step overwrites: parameters and their optimizer state, copied by
    :meth:`take` so :meth:`restore` puts them back bit for bit (state the step creates is
    removed again). The copies live in buffers kept from one step to the next: allocating them
    at every step would cost more than the copy."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.values: list[torch.Tensor] = []
        self.states: list[dict[str, Any] | None] = [None] * len(self.params)

    @torch.no_grad()
    def take(self) -> None:
        if not self.values:
            self.values = [torch.empty_like(param) for param in self.params]
        for value, param in zip(self.values, self.params):
            value.copy_(param)
        self.states = [
            self._copy(self.optimizer.state.get(param), kept) for param, kept in zip(self.params, self.states)
        ]

    @staticmethod
    def _copy(state: dict[str, Any] | None, kept: dict[str, Any] | None) -> dict[str, Any] | None:
        """``state`` copied, into the buffers of ``kept`` where they fit."""
        if not state:
            return None
        copied: dict[str, Any] = {}
        for key, value in state.items():
            if not torch.is_tensor(value):
                copied[key] = value
                continue
            buffer = (kept or {}).get(key)
            if torch.is_tensor(buffer) and buffer.shape == value.shape and buffer.dtype == value.dtype:
                copied[key] = buffer.copy_(value)
            else:
                copied[key] = value.clone()
        return copied

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
