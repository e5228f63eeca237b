"""The executor's side of vocabulary parallelism: one handler per vocabulary op of the schedule IR
(``docs/vocab_parallel.md``, "Ops") and the per-step state they share, on top of the numerics of
``vocab_parallel.py``.

:func:`setup_vocab_parallel` prepares a rank's chunks once, before DDP wrapping: the shard
(:class:`VocabParallel`) becomes a submodule of the rank's first chunk (so DDP, the optimizer,
clipping and ``finalize_model_grads`` see it), the first stage's word embedding is fed from
REDUCE_EMB and the last stage's output layer returns the final hidden state. The executor then
builds one :class:`VocabStep` per step. Collectives are issued where they stand in the op list
and waited for only by the op that needs their result, so every rank issues a channel's
collectives in the same order and none blocks at issue. What nothing in the pipeline waits for
(the non-root ends of reduces, BCAST_DEMB) is finished as it completes and at the end of the step,
before the gradients of the chunk holding the shard are synchronised.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..schedule.ir import Op, OpKind, Placement, Schedule
from .context_parallel import cp_size_of
from .memory import ActivationMeter, Hold
from .stage import Key, LossRecord, StageRunner
from .vocab_parallel import (
    EmbeddingFeed,
    OutputCapture,
    Pending,
    VocabParallel,
    install_embedding_feed,
    install_output_capture,
)

# What a forward-only step keeps of the vocabulary ops (no gradients: no T, REDUCE_T, BCAST_DEMB).
FORWARD_KINDS = (OpKind.BCAST_X, OpKind.S, OpKind.REDUCE_S, OpKind.BCAST_IDS, OpKind.REDUCE_EMB)


class VocabRuntimeError(RuntimeError):
    """A vocabulary op could not run (missing input, unsupported setting)."""


@dataclass
class VocabSetup:
    """One rank's vocabulary-parallel pieces: the shard, the first stage's embedding feed and the
    last stage's output capture (None where the rank does not hold that stage), and the chunk the
    shard is registered in."""

    vp: VocabParallel
    feed: EmbeddingFeed | None
    capture: OutputCapture | None
    chunk_index: int = 0

    @property
    def variant(self) -> str:
        return self.vp.variant


def setup_vocab_parallel(
    chunks: Sequence[torch.nn.Module],
    placement: Placement,
    rank: int,
    vocab_size: int,
    hidden_size: int,
    variant: str,
    **vp_kwargs: Any,
) -> VocabSetup:
    """Prepare this rank's chunks (GPTModels, not yet DDP-wrapped) for a vocabulary-parallel
    schedule with ``placement``: creates the shard (collective: every rank calls it, in the same
    order) with the placement's loss rank, registers it as ``chunks[0].vocab_parallel`` and
    installs the embedding feed / output capture on the chunks of the first / last stage.
    ``vp_kwargs`` go to :class:`VocabParallel` (``sequence_parallel``, ``dtype``, ``device``...)."""
    last = placement.num_stages - 1
    loss_rank = placement.rank_of(last)
    vp = VocabParallel(vocab_size, hidden_size, variant=variant, loss_rank=loss_rank, **vp_kwargs)
    if placement.rank_of(0) != 0:
        raise VocabRuntimeError("vocabulary parallelism needs the first stage on pipeline rank 0")
    stages = placement.stages_of(rank)
    feed = install_embedding_feed(chunks[placement.chunk_index(0)]) if 0 in stages else None
    capture = install_output_capture(chunks[placement.chunk_index(last)]) if last in stages else None
    chunks[0].vocab_parallel = vp
    return VocabSetup(vp, feed, capture, 0)


class _Peeking:
    """The first stage's data iterator, read ahead by BCAST_IDS (which needs each unit's tokens
    before its F); the forward then gets the same batch of its (microbatch, slice) unit. Under
    sequence slices ``source`` is the chunk's SliceFeeder: each read selects its unit first, and
    the runtime's ``select`` before the forward names the unit to hand over."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.ahead: dict[Key, Any] = {}
        self.order: deque[Key] = deque()
        self.current: Key | None = None

    def pull(self, key: Key) -> Any:
        select = getattr(self.source, "select", None)
        if select is not None:
            select(*key)
        batch = next(self.source)
        self.ahead[key] = batch
        self.order.append(key)
        return batch

    def select(self, microbatch: int, slice_index: int) -> None:
        self.current = (microbatch, slice_index)

    def __iter__(self) -> _Peeking:
        return self

    def __next__(self) -> Any:
        key = self.current if self.current in self.ahead else (self.order[0] if self.order else None)
        if key is None:
            if self.current is not None and hasattr(self.source, "select"):
                self.source.select(*self.current)
            return next(self.source)
        self.order.remove(key)
        return self.ahead.pop(key)


def _completed(pending: Pending[Any]) -> bool:
    """Whether an asynchronous step finished (so ``wait`` will not block)."""
    work = pending._work
    if work is None:
        return True
    if hasattr(work, "done"):
        return bool(work.done())
    return bool(getattr(work, "is_completed", lambda: False)())


class VocabStep:
    """One step's vocabulary ops on one rank. Keys are (microbatch, slice): under sequence slices
    every op runs per unit (token ids, labels, g and the losses of the slice); S, T and the
    collectives are per token and need nothing from the chunks' slice context. Training with
    slices needs ``calculate_per_token_loss`` (g of a slice is then known at its forward)."""

    def __init__(
        self,
        setup: VocabSetup,
        schedule: Schedule,
        rank: int,
        runners: dict[int, StageRunner],
        iterators: list[Iterator[Any] | None],
        meter: ActivationMeter,
        losses: LossRecord,
        share_shape: Callable[[Op], Sequence[int]],
        batch_shape: Callable[[Op], tuple[int, int]],
        *,
        forward_only: bool,
        collect_non_loss_data: bool,
    ) -> None:
        config = next(iter(runners.values())).config if runners else None
        per_token = getattr(config, "calculate_per_token_loss", False)
        if schedule.slices > 1 and not per_token and not forward_only:
            raise VocabRuntimeError(
                f"--pp-vocab-parallel with sequence slices ({schedule.name}, {schedule.slices} slices) "
                "needs --calculate-per-token-loss (TransformerConfig.calculate_per_token_loss=True): "
                "otherwise the loss gradient of a slice depends on the token count of the whole "
                "microbatch, unknown at the slice's forward"
            )
        self.setup = setup
        self.vp = setup.vp
        self.placement = schedule.placement
        self.last = schedule.num_stages - 1
        self.num_microbatches = schedule.microbatches
        self.is_loss_rank = self.placement.rank_of(self.last) == rank
        self.is_first_rank = self.placement.rank_of(0) == rank
        if self.is_loss_rank and self.vp.last != rank:
            raise VocabRuntimeError(
                f"the shard's loss rank is {self.vp.last}, the schedule's is {rank}: set it up with "
                "this placement (setup_vocab_parallel)"
            )
        self.runners = runners
        self.meter = meter
        self.losses = losses
        self.share_shape = share_shape
        self.batch_shape = batch_shape
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.peek: _Peeking | None = None
        # context parallelism: each CP rank embeds its two pieces of every sequence
        self.cp_group = next(iter(runners.values())).cp_group if runners else None
        self.cp_size = cp_size_of(config) if config is not None else 1
        self.ids_over_tp = False  # only TP rank 0 of the first stage reads data: it sends the ids
        if self.is_first_rank:
            index = self.placement.chunk_index(0)
            source = iterators[index]
            self.ids_over_tp = self._some_tp_rank_lacks_data(source is None)
            if source is None and not (self.ids_over_tp and self.vp.groups.tp_rank > 0):
                raise VocabRuntimeError(
                    "vocabulary parallelism: the first stage needs its data iterator (BCAST_IDS reads "
                    "the tokens before the forward; under TP, at least on TP rank 0)"
                )
            if source is not None and (not self.ids_over_tp or self.vp.groups.tp_rank == 0):
                self.peek = _Peeking(source)
                iterators[index] = self.peek
        self._outputs: dict[Key, tuple[Tensor, Tensor, Tensor, Hold]] = {}  # loss rank: X, labels, g
        self._x: dict[Key, Pending[Any]] = {}
        self._states: dict[Key, tuple[Any, list[Hold]]] = {}
        self._reduced: dict[Key, Pending[Any]] = {}  # REDUCE_S in flight
        self._parts: dict[Key, tuple[Tensor, Hold]] = {}  # vocab-1: T's input-gradient part
        self._grads: dict[Key, tuple[Pending[Any], list[Hold]]] = {}  # the last stage's output grad
        self._ids: dict[Key, Pending[Any]] = {}
        self._emb: dict[Key, Pending[Any]] = {}
        self._demb_grads: dict[Key, Tensor] = {}
        self._demb: list[tuple[Pending[Any], Pending[Any]]] = []
        self._unwaited: list[tuple[Pending[Any], list[Hold]]] = []  # results nobody here needs
        self._handlers: dict[OpKind, Callable[[Op, Key], None]] = {
            OpKind.BCAST_X: self._bcast_x,
            OpKind.S: self._s,
            OpKind.REDUCE_S: self._reduce_s,
            OpKind.T: self._t,
            OpKind.REDUCE_T: self._reduce_t,
            OpKind.BCAST_IDS: self._bcast_ids,
            OpKind.REDUCE_EMB: self._reduce_emb,
            OpKind.BCAST_DEMB: self._bcast_demb,
        }

    # ---- dispatch -------------------------------------------------------------------------------

    def run(self, op: Op) -> None:
        """Run one vocabulary op (issue a collective, or compute S / T)."""
        self._handlers[op.kind](op, (op.microbatch, op.slice))
        self._reap()

    # ---- hooks of the pipeline's own ops ---------------------------------------------------------

    def take_output(self, op: Op, hidden: Tensor) -> None:
        """The last stage's F (loss rank): keep X, its labels and g for BCAST_X."""
        key = (op.microbatch, op.slice)
        runner = self.runners[op.stage]
        assert self.setup.capture is not None
        labels = self.setup.capture.take_labels()
        loss_func = runner.loss_funcs.get(key)
        dtype = torch.float64 if self.vp.output_weight.dtype == torch.float64 else torch.float32
        if self.forward_only or self.collect_non_loss_data:
            grad = torch.zeros(tuple(labels.shape), dtype=dtype, device=hidden.device)
        elif loss_func is None:
            raise VocabRuntimeError(
                "vocabulary parallelism needs the loss_func of the last stage's forward_step"
            )
        else:
            grad = runner.loss_gradient(loss_func, labels.shape, dtype, hidden.device, self.num_microbatches)
        self._outputs[key] = (hidden, labels, grad, self.meter.hold(hidden))

    def embedding(self, op: Op) -> Tensor:
        """The first stage's F: REDUCE_EMB's sum, fed to the chunk's word embedding as a leaf; the
        runner keeps it as the unit's input (its gradient is what BCAST_DEMB sends)."""
        key = (op.microbatch, op.slice)
        pending = self._emb.pop(key, None)
        if pending is None:
            raise VocabRuntimeError(
                f"{op} has no word embedding: REDUCE_EMB{op.stage}:{op.microbatch} did not run"
            )
        leaf = pending.wait().detach()
        if not self.forward_only:
            leaf.requires_grad_(True)
        assert self.setup.feed is not None
        self.setup.feed.put(leaf)
        return leaf

    def output_grad(self, op: Op) -> Tensor:
        """The last stage's B/BW (loss rank): the gradient of its output, from REDUCE_T (vocab-1)
        or REDUCE_S (vocab-2)."""
        item = self._grads.pop((op.microbatch, op.slice), None)
        if item is None:
            raise VocabRuntimeError(f"{op} has no output gradient: its T / reduce did not run")
        pending, holds = item
        grad = pending.wait()
        for hold in holds:
            hold.release()
        if grad is None:
            raise VocabRuntimeError(f"{op}: the input-gradient reduce gave nothing on the loss rank")
        return grad

    def embedding_grad(self, op: Op, grad: Tensor | None) -> None:
        """The first stage's B/BW: the gradient of the word-embedding output, for BCAST_DEMB."""
        if grad is None:
            raise VocabRuntimeError(f"{op} produced no gradient of the word embedding")
        self._demb_grads[(op.microbatch, op.slice)] = grad

    # ---- the ops --------------------------------------------------------------------------------

    def _bcast_x(self, op: Op, key: Key) -> None:
        share = tuple(int(n) for n in self.share_shape(op))
        if self.is_loss_rank:
            item = self._outputs.pop(key, None)
            if item is None:
                raise VocabRuntimeError(f"{op} before the last stage's forward of the unit")
            hidden, labels, grad, hold = item
            self._x[key] = self.vp.s_broadcast(hidden, labels, share, grad, async_op=True)
            hold.release()  # packed into the broadcast buffer at issue
        else:
            self._x[key] = self.vp.s_broadcast(None, None, share, None, async_op=True)

    def _s(self, op: Op, key: Key) -> None:
        pending = self._x.pop(key, None)
        if pending is None:
            raise VocabRuntimeError(f"{op} before its BCAST_X")
        state = self.vp.s_forward(*pending.wait())
        self._states[key] = (state, self.meter.hold_all(state.tensors()))

    def _reduce_s(self, op: Op, key: Key) -> None:
        if key not in self._states:
            raise VocabRuntimeError(f"{op} before its S")
        self._reduced[key] = self.vp.s_reduce(self._states[key][0], async_op=True)

    def _t(self, op: Op, key: Key) -> None:
        if key not in self._states or key not in self._reduced:
            raise VocabRuntimeError(f"{op} before its S / REDUCE_S")
        state, holds = self._states.pop(key)
        reduced = self._reduced.pop(key)
        self._report(op, key, state)
        part = self.vp.t_backward(state)
        for hold in holds:
            hold.release()
        if self.vp.variant == "vocab-1":
            assert part is not None
            self._parts[key] = (part, self.meter.hold(part))
        elif self.is_loss_rank:
            self._grads[key] = (reduced, [])
        # vocab-2 elsewhere: t_backward settled the reduce; nothing comes back here

    def _reduce_t(self, op: Op, key: Key) -> None:
        item = self._parts.pop(key, None)
        if item is None:
            raise VocabRuntimeError(f"{op} before its T")
        part, hold = item
        pending = self.vp.t_reduce(part, async_op=True)
        if self.is_loss_rank:
            self._grads[key] = (pending, [hold])
        else:
            self._unwaited.append((pending, [hold]))

    def _some_tp_rank_lacks_data(self, lacking: bool) -> bool:
        """Whether a TP rank of the first stage has no data iterator (Megatron-LM builds loaders
        on TP rank 0 only); collective over the first stage's TP group."""
        group = self.vp.groups.tp_ids
        if group is None:
            return False
        flag = torch.tensor([int(lacking)], dtype=torch.int64, device=self.vp.embedding_weight.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _bcast_ids(self, op: Op, key: Key) -> None:
        tokens = None
        if self.peek is not None:
            batch = self.peek.pull(key)
            tokens = batch.get("tokens") if isinstance(batch, dict) else None
            if tokens is None:
                raise VocabRuntimeError(
                    "vocabulary parallelism reads the token ids of the first stage's batches: "
                    "its data iterator must give dicts with 'tokens'"
                )
        if tokens is not None and self.cp_group is not None:
            from ..attention.cp_layout import take_local

            tokens = take_local(tokens, 1, self.cp_size, torch.distributed.get_rank(self.cp_group))
        if self.ids_over_tp:
            tokens = self.vp.ids_from_tp_rank_0(tokens, self.batch_shape(op))
        self._ids[key] = self.vp.e_ids(tokens, self.batch_shape(op), async_op=True)

    def _reduce_emb(self, op: Op, key: Key) -> None:
        ids = self._ids.get(key)
        if ids is None:
            raise VocabRuntimeError(f"{op} before its BCAST_IDS")
        pending = self.vp.e_reduce(self.vp.e_forward(ids.wait()), async_op=True)
        if self.is_first_rank:
            self._emb[key] = pending
        else:
            self._unwaited.append((pending, []))
        if self.forward_only:
            self._unwaited.append((self._ids.pop(key), []))

    def _bcast_demb(self, op: Op, key: Key) -> None:
        ids = self._ids.pop(key, None)
        if ids is None:
            raise VocabRuntimeError(f"{op} before its BCAST_IDS")
        grad = None
        if self.is_first_rank:
            grad = self._demb_grads.pop(key, None)
            if grad is None:
                raise VocabRuntimeError(f"{op} before the first stage's backward of the unit")
        self._demb.append((ids, self.vp.e_grad(grad, self.batch_shape(op), async_op=True)))

    # ---- completion -----------------------------------------------------------------------------

    def _report(self, op: Op, key: Key, state: Any) -> None:
        """The loss report on the loss rank, from REDUCE_S's per-token losses."""
        if self.is_loss_rank:
            runner = self.runners[self.last]
            runner.report_loss(
                key, self.vp.loss(state), self.num_microbatches, self.losses, self.collect_non_loss_data
            )

    def _reap(self) -> None:
        """Finish what completed and nothing waits for (frees its buffers, adds embedding grads)."""
        keep = []
        for pending, holds in self._unwaited:
            if _completed(pending):
                pending.wait()
                for hold in holds:
                    hold.release()
            else:
                keep.append((pending, holds))
        self._unwaited = keep
        if self.vp.scatter_embeddings:
            # BCAST_DEMB's result is gathered over TP at wait: a wait when it happens to complete
            # would order that TP collective differently on the TP ranks (deadlock): finish() does it.
            return
        while self._demb and _completed(self._demb[0][0]) and _completed(self._demb[0][1]):
            ids, grad = self._demb.pop(0)
            self.vp.e_backward(ids.wait(), grad.wait())

    def finish(self) -> None:
        """End of the step: finish every collective, add the embedding gradients, and (forward
        only, where there is no T) report the losses."""
        for key in sorted(self._states):
            state, holds = self._states.pop(key)
            self._reduced.pop(key, None)
            self._report(Op(OpKind.T, self.last, *key), key, state)
            state.settle()
            for hold in holds:
                hold.release()
        for pending, holds in self._unwaited:
            pending.wait()
            for hold in holds:
                hold.release()
        self._unwaited = []
        for ids, grad in self._demb:
            self.vp.e_backward(ids.wait(), grad.wait())
        self._demb = []
        if not self.is_loss_rank:
            for pending, holds in self._grads.values():
                pending.wait()
                for hold in holds:
                    hold.release()
            self._grads.clear()

    def leftover(self) -> list[str]:
        """Units whose vocabulary ops did not all run (should be none after a step)."""
        found = [f"vocabulary {name} of unit {key}" for name, table in self._tables() for key in table]
        return found

    def _tables(self) -> list[tuple[str, dict[Key, Any]]]:
        return [
            ("output without BCAST_X", self._outputs),
            ("BCAST_X without S", self._x),
            ("S without T", self._states),
            ("T without REDUCE_T", self._parts),
            ("output gradient without B", self._grads),
            ("ids without BCAST_DEMB", self._ids),
            ("embedding without F", self._emb),
            ("embedding gradient without BCAST_DEMB", self._demb_grads),
        ]

    def discard(self) -> None:
        """Drop everything held (after a failed step); collectives in flight are abandoned."""
        for _, table in self._tables():
            table.clear()
        self._unwaited = []
        self._demb = []
