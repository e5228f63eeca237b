"""The per-step features as :class:`StepFeature` collaborators (``step_feature.py``).

Each is a thin adapter: the classes keep their own interface (``GradSync.before(position)``,
``StepRedistribution.running(op)``, ...), and the adapter says when the executor's calls reach
them. The executor builds a step's list from the lowered schedule (``executor._StepRun``); each
adapter is tested alone in tests/test_step_features.py.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..schedule.ir import Op
from .grad_sync import GradSync
from .offload import OffloadEngine
from .redistribution import StepRedistribution
from .slicing import StepSlicing
from .step_feature import OpFailure, StepFeature
from .vocab_ops import VocabStep


class Restart(Exception):
    """The validation gate rolled the previous optimizer step back: run the step again."""


class RngState:
    """torch's random state (and the accelerator's) when a step attempt starts, so a restarted
    step draws the same numbers (dropout)."""

    def __init__(self) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.tracker = get_cuda_rng_tracker()
        self.tracked = self.tracker.get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        self.tracker.set_states(self.tracked)


class GateFeature(StepFeature):
    """Optimizer post-validation (``schedule/gate.py``): ``settle`` the previous optimizer step
    ahead of op ``position`` (at the end for a rank with forwards only); False means that step
    was redone, and the attempt restarts (:class:`Restart`) from the random state it began with."""

    def __init__(self, settle: Callable[[], bool], position: int) -> None:
        self.settle = settle
        self.position: int | None = position  # None once passed
        self.rng = RngState()

    def before(self, position: int, op: Op) -> None:
        if position == self.position:
            self._pass()

    def finish(self) -> None:
        if self.position is not None:  # a rank with forwards only
            self._pass()

    def discard(self, error: BaseException) -> None:
        if isinstance(error, Restart):
            self.rng.restore()

    def _pass(self) -> None:
        self.position = None
        if not self.settle():
            raise Restart()


class GradSyncFeature(StepFeature):
    """Megatron's DDP sync calls (``grad_sync.py``). Chunks whose gradients land only at the
    step's end (the vocabulary shards') act at ``sync.end``, once the features before this one
    (the vocabulary's collectives) have finished."""

    def __init__(self, sync: GradSync, rank: int) -> None:
        self.sync = sync
        self.rank = rank

    def begin(self) -> None:
        self.sync.begin()

    def before(self, position: int, op: Op) -> None:
        with OpFailure(self.rank, position, op):  # the parameter gather is started for this op
            self.sync.before(position)

    def after(self, position: int, op: Op) -> None:
        self.sync.after(position)

    def finish(self) -> None:
        self.sync.after(self.sync.end)  # nothing acts there without late chunks
        self.sync.finish()

    def discard(self, error: BaseException) -> None:
        self.sync.finish()


class VocabFeature(StepFeature):
    """The vocabulary passes' end of step (``vocab_ops.VocabStep``): its collectives finished
    and the embedding gradients added, or everything held dropped. Its ops, and its part in F
    and B, are the executor's."""

    def __init__(self, vocab: VocabStep) -> None:
        self.vocab = vocab

    def finish(self) -> None:
        self.vocab.finish()

    def discard(self, error: BaseException) -> None:
        self.vocab.discard()


class OffloadFeature(StepFeature):
    """The offload engine's step (``offload.py``), armed for a rank whose ops offload: every
    offloaded unit reloaded and the copies waited for, or the records dropped."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine

    def finish(self) -> None:
        self.engine.finish()

    def discard(self, error: BaseException) -> None:
        self.engine.discard()


class SlicingFeature(StepFeature):
    """Sequence slices (``slicing.py``): a failed step's K/V caches dropped. Which unit a
    forward runs is the executor's (``StepSlicing.running`` around the chunk's forward)."""

    def __init__(self, slicing: StepSlicing) -> None:
        self.slicing = slicing

    def discard(self, error: BaseException) -> None:
        self.slicing.release()


class RedistributionFeature(StepFeature):
    """SlimPipe's attention redistribution (``redistribution.py``): ``running(op)`` around every
    op it involves, entered ahead of the op and left after it; an op that failed leaves it at
    ``discard`` with its error, as a ``with`` would have (the delegation cleared, no DONE sent,
    no service finished). The step's attention counts are ``step.counts`` once finished."""

    def __init__(self, step: StepRedistribution, rank: int) -> None:
        self.step = step
        self.rank = rank
        self._around: AbstractContextManager[Any] | None = None  # entered for the running op

    def before(self, position: int, op: Op) -> None:
        if not self.step.involves(op):
            return
        with OpFailure(self.rank, position, op):
            around = self.step.running(op)
            around.__enter__()
        self._around = around

    def after(self, position: int, op: Op) -> None:
        around, self._around = self._around, None
        if around is not None:
            around.__exit__(None, None, None)

    def finish(self) -> None:
        self.step.finish()

    def discard(self, error: BaseException) -> None:
        around, self._around = self._around, None
        if around is not None:
            around.__exit__(type(error), error, error.__traceback__)
        self.step.abandon()
