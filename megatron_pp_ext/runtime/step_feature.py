"""What a per-step feature is to the executor: a collaborator with five calls.

A step (``executor._StepRun.execute``) runs this rank's op list; each feature of the step (the
validation gate, the step's messages, vocabulary parallelism, gradient sync, the stages' state,
offload, attention redistribution, sequence slices: ``features.py`` and the executor) is called

- ``begin()`` once, before the first op, in list order;
- ``before(position, op)`` ahead of every op, in list order, outside the op's failure report:
  what goes wrong there is not the op's (the validation gate settles the previous optimizer
  step there); a feature that starts work for the op names the op itself (:class:`OpFailure`);
- ``after(position, op)`` once the op has run, in reverse list order (like nested contexts: what
  ``before`` opened last closes first), inside the op's failure report; not after a failed op;
- ``finish()`` after the last op, in list order: the order the step's end needs (the gate
  settles before the messages are flushed, the vocabulary collectives finish before the
  gradients sync, ...);
- ``discard(error)`` when the attempt failed with ``error`` (or the gate restarts it), in reverse
  list order (the offload engine waits for its copies before the stages let go of the tensors
  being copied; the messages and the gate, first in the list, restart or abandon last), instead
  of whatever of ``after``/``finish`` did not run: the feature lets go of the step. Every
  feature is discarded, also one whose ``begin`` never ran.

Megatron's schedules hook DDP in the same way (``config.no_sync_func``/``grad_sync_func``);
:class:`StepFeature` has no-op defaults, so a feature writes only the calls it needs.
"""

from __future__ import annotations

from types import TracebackType

from ..schedule.ir import Op
from .peer_error import PeerError


class PipelineError(RuntimeError):
    """An op failed; the message names the rank and the op."""


class StepFeature:
    """One feature of one step (see the module docstring for when each call comes)."""

    def begin(self) -> None:
        """Before the step's first op."""

    def before(self, position: int, op: Op) -> None:
        """Ahead of op ``position`` of the rank's list."""

    def after(self, position: int, op: Op) -> None:
        """Once op ``position`` has run."""

    def finish(self) -> None:
        """After the step's last op."""

    def discard(self, error: BaseException) -> None:
        """The attempt failed with ``error``: let go of the step."""


class OpFailure:
    """``with OpFailure(rank, position, op):`` reports a failure inside as the op's: a
    :class:`PipelineError` naming the rank, the op and its position, raised from the error.
    PipelineError and PeerError (CreationError is one) already name what failed and pass as they
    are, and so does anything that is not an ``Exception`` (KeyboardInterrupt)."""

    def __init__(self, rank: int, position: int, op: Op) -> None:
        self.rank = rank
        self.position = position
        self.op = op

    def __enter__(self) -> OpFailure:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if not isinstance(error, Exception) or isinstance(error, (PipelineError, PeerError)):
            return False
        raise PipelineError(
            f"rank {self.rank}: op {self.op} (position {self.position}) failed: {error}"
        ) from error
