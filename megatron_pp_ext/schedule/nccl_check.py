"""Does a lowered schedule complete under NCCL's rules? Our tests run on gloo; users run NCCL.

NCCL differs from gloo in three ways that can hang a schedule the validator accepts:

1. lazy creation: without a warm-up, a communicator is created at its first use (a group's
   first collective; for point-to-point, one 2-rank communicator per (group, low rank, high
   rank)), and creating it blocks the host of every member until all of them arrive there;
2. rendezvous: a large send (every activation and vocabulary message) completes only when its
   receive is posted;
3. in-order completion (``strict``): with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a GPU completes its
   communication in launch order, across all its communicators; a ``batch_isend_irecv`` counts as
   one unit. Without ``strict`` only each communicator is in order.

:func:`check_nccl` replays the schedule as the runtime issues it (``runtime/executor.py``,
``p2p.py``, ``vocab_ops.py``, ``vocab_parallel.py``, ``redistribution.py``) on the engine of
``nccl_replay.py`` and names the first stuck rank, its op, the communicator and the peers it
waits for. How each op is issued:

* SEND_F/SEND_B: ``isend`` on one of four groups, one per (F or B, towards a higher or a lower
  rank); the host goes on; the end of the step waits for every send (flush). RECV_F/RECV_B:
  ``irecv`` on the sender's group, posted where it stands (lowering puts it in the step's global
  message order, ``message_order.py``); the host waits for it when the op that consumes the
  message is about to run.
* Vocabulary collectives are issued where they stand, asynchronously, on the groups ``x``
  (BCAST_X), ``stats`` (REDUCE_S's all-gather), ``out`` (REDUCE_T; vocab-2's REDUCE_S reduce,
  issued by a worker thread once the all-gather is in) and ``emb`` (BCAST_IDS, REDUCE_EMB,
  BCAST_DEMB). Waiting for one is a stream wait on NCCL, not a host wait: S waits for its
  BCAST_X, T for REDUCE_S, REDUCE_EMB for BCAST_IDS, the first stage's F for REDUCE_EMB and the
  last stage's backward for the input-gradient reduce. Under vocab-2, T waits on the host for
  the worker (``Pending.wait`` of a future), and the worker's own waits (the all-gather, then its
  reduce) land on the default stream it shares with the main thread as soon as REDUCE_S is
  issued. Every send and receive launched after a stream wait runs after what it waited for.
* SlimPipe's attention redistribution (``delegations``, from ``redistribute.delegation_plan``):
  the heavy op sends a small header and its Q/K/V on the pair's own group, posts the answer's
  receive and waits for all three, then sends a small DONE header. The partner serves it on its
  main thread, inside the light op of the same lock-step slot: it receives the header and the
  request, sends the answer and waits for both, then receives the DONE. (Per attention layer the
  request and answer repeat; one of each stands for them here, their order being the same.)
* OFFLOAD/RELOAD copies and compute talk to no other rank.
* Optimizer post-validation (``chain``, the order the partial gradient state visits the ranks,
  ``megatron/post_validation.py``): after the step's flush every rank launches the global
  all-reduce, then receives the partial state from the rank before it in the chain (the host
  waits) and sends it on to the next without waiting (a small message).

Left out: collectives outside the pipeline (tensor, context and data parallel groups: the same
on every replica, so they cannot order one pipeline's ranks differently). A helper thread is
taken to launch the moment it may: the runtime makes that so, the main thread reserving the
helper's places in its launch order (``runtime/launch_order.py``, ``Launcher.reserve``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .ir import BACKWARD_KINDS, COMM_KINDS, Op, OpKind, Schedule, format_op
from .lowering import lower
from .nccl_replay import CommOp, Condition, Program, Replay, Thread, Unit
from .replay import message_key as simulate_message_key
from .vocab import Layout

VOCAB_GROUPS: dict[OpKind, str] = {
    OpKind.BCAST_X: "vocab-x",
    OpKind.REDUCE_S: "vocab-stats",
    OpKind.REDUCE_T: "vocab-out",
    OpKind.BCAST_IDS: "vocab-emb",
    OpKind.REDUCE_EMB: "vocab-emb",
    OpKind.BCAST_DEMB: "vocab-emb",
}
WORKER_GROUP = "vocab-out"  # vocab-2's REDUCE_S reduce, issued by the worker thread
POST_VALIDATION_GROUP = "post-validation all-reduce"  # the model-parallel group's
SENDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
Launch = Generator[Condition, None, Unit]

FIX_CREATION = (
    "create every communicator up front in one global order (warm-up), or make every rank's "
    "first uses of its communicators come in one order"
)
FIX_ORDER = (
    "launch the two ranks' operations in one order, or batch the adjacent send and receive into "
    "one batch_isend_irecv"
)
FIX_RENDEZVOUS = "post the receive before the peer blocks (a large send completes only with its receive)"
FIX_COLLECTIVE = "issue each group's collectives where every rank can reach them, in one order"


@dataclass(frozen=True)
class Hang:
    """Where a schedule hangs: the first stuck rank, the op it waits at, the communicator
    (``channel``) and the ranks it waits for; ``waits`` has one line per stuck thread."""

    rank: int
    position: int
    op: Op
    channel: str
    peers: tuple[int, ...]
    reason: str
    fix: str = ""
    waits: tuple[str, ...] = ()

    def message(self) -> str:
        """One line: the rank, op and channel, whom it waits for and why, and a fix."""
        who = ", ".join(f"rank {peer}" for peer in self.peers) or "no other rank"
        text = (
            f"rank {self.rank} waits at {format_op(self.op)} (position {self.position}) on channel "
            f"{self.channel} for {who}{', ' if self.reason.startswith('which') else ': '}{self.reason}"
        )
        return text + (f"; fix: {self.fix}" if self.fix else "")

    def __str__(self) -> str:
        return self.message()


def check_nccl(
    schedule: Schedule,
    *,
    strict: bool = True,
    warmed: bool = False,
    batch: bool = False,
    delegations: Mapping[tuple[int, Op], Any] | None = None,
    chain: Sequence[int] | None = None,
) -> Hang | None:
    """None if ``schedule`` completes one step under NCCL's rules, else where it hangs.

    ``strict``: in-order completion on each GPU (rule 3) on top of rules 1-2. ``warmed``: every
    communicator exists before the step (no lazy creation). ``batch``: a runtime that sends all
    p2p on one group (torch batches only ops of one group) and issues each run of adjacent
    SEND/RECV ops (copies between them ignored) as one ``batch_isend_irecv``. ``delegations``:
    SlimPipe's plan, ``{(rank, op): Delegation}`` (with ``.partner`` and ``.light``). ``chain``:
    optimizer post-validation after the step, its partial state visiting the ranks in this order.
    The schedule should pass ``validate``: messages match in order, as on NCCL."""
    if schedule.pp > 1 and not schedule.is_lowered:
        schedule = lower(schedule)
    if schedule.pp < 2:
        return None
    replay = Replay(schedule.pp, strict, warmed)
    model = _Model(schedule, replay, batch, delegations or {}, chain)
    stuck = replay.run()
    if stuck:
        return model.explain(stuck)
    left = replay.left_over()
    return None if left is None else model.left_over(left)


def nccl_summary(schedule: Schedule) -> dict[str, str | None]:
    """The three checks ``simulate`` reports (None: completes; else the hang's message):
    ``strict`` and ``relaxed`` with every communicator warmed up (rules 2-3, rule 2) as the
    runtime does (``runtime/creation.py``), and ``lazy_creation``, each communicator created at
    its first use (rules 1-2), which is what a runtime without the warm-up would meet."""
    found = {
        "strict": check_nccl(schedule, strict=True, warmed=True),
        "relaxed": check_nccl(schedule, strict=False, warmed=True),
        "lazy_creation": check_nccl(schedule, strict=False, warmed=False),
    }
    return {key: None if hang is None else hang.message() for key, hang in found.items()}


def p2p_channel(sender: int, receiver: int, direction: str, batch: bool = False) -> str:
    """The communicator of a message: ``p2p-F-up pair 0-1`` (the group, then the pair)."""
    low, high = sorted((sender, receiver))
    if batch:
        return f"p2p pair {low}-{high}"
    return f"p2p-{direction}-{'up' if receiver > sender else 'down'} pair {low}-{high}"


def post_validation_pair(sender: int, receiver: int) -> str:
    low, high = sorted((sender, receiver))
    return f"post-validation pair {low}-{high}"


def attention_channel(source: int, partner: int) -> str:
    low, high = sorted((source, partner))
    return f"attention {source}->{partner} pair {low}-{high}"


def _batches(ops: list[Op]) -> dict[int, list[int]]:
    """Runs of adjacent SEND/RECV ops (copies between them skipped): first position -> run."""
    runs: dict[int, list[int]] = {}
    current: list[int] | None = None
    for position, op in enumerate(ops):
        if op.is_comm:
            if current is None:
                current = runs.setdefault(position, [])
            current.append(position)
        elif not op.is_copy:
            current = None
    return runs


class _Model:
    """The runtime's threads for every rank of one schedule, as programs on ``replay``."""

    def __init__(
        self,
        schedule: Schedule,
        replay: Replay,
        batch: bool,
        delegations: Mapping[tuple[int, Op], Any],
        chain: Sequence[int] | None = None,
    ) -> None:
        self.schedule = schedule
        self.chain = list(chain) if chain is not None else None
        if self.chain is not None and sorted(self.chain) != list(range(schedule.pp)):
            raise ValueError(f"chain {self.chain} is not an order of the {schedule.pp} pipeline ranks")
        self.replay = replay
        self.batch = batch
        self.variant = schedule.vocab_parallel
        self.layout = Layout.of(schedule)
        everyone = range(schedule.pp)
        for group in (*VOCAB_GROUPS.values(), WORKER_GROUP, POST_VALIDATION_GROUP):
            replay.comm(group, everyone)
        # (rank, heavy op) -> partner; (partner, light op) -> the (source rank, heavy op) it serves
        self.delegated: dict[tuple[int, Op], int] = {}
        self.serves: dict[tuple[int, Op], list[tuple[int, Op]]] = defaultdict(list)
        for (rank, op), delegation in sorted(delegations.items(), key=lambda item: item[0][0]):
            light = getattr(delegation, "light", None)
            if light is None:
                raise ValueError(f"the delegation of rank {rank}'s {format_op(op)} names no light op")
            self.delegated[(rank, op)] = delegation.partner
            self.serves[(delegation.partner, light)].append((rank, op))
        self.vocab: dict[tuple[int, str, int, int], Unit] = {}
        # (rank, direction, stage, microbatch, slice) -> the posted receive of that message
        self.received: dict[tuple[int, str, int, int, int], tuple[Unit, CommOp]] = {}
        self.mains: list[Thread] = []
        for rank in everyone:  # the helper first: it starts before the step's first op
            if self.variant == "vocab-2":
                worker = Thread(rank, "vocab-2 worker")
                replay.start(worker, self._worker(worker))
            main = Thread(rank, "main")
            self.mains.append(main)
            replay.start(main, self._main(main))

    # ---- helpers for the programs ----------------------------------------------------------

    def _launch(self, thread: Thread, ops: list[CommOp]) -> Launch:
        """Create the communicators of ``ops`` (blocking at lazy creation), then launch them as
        one unit and return it."""
        for op in ops:
            if op.comm not in self.replay.created:
                thread.position, thread.op = op.position, op.source
            yield from self.replay.create(thread, [op.comm])
        return self.replay.launch(thread.rank, ops)

    def _wait(self, thread: Thread, unit: Unit) -> Program:
        if not unit.done:
            yield ("unit", unit)

    def _vocab_unit(self, rank: int, tag: str, op: Op) -> Unit:
        found = self.vocab.get((rank, tag, op.microbatch, op.slice))
        if found is None:
            raise ValueError(
                f"rank {rank}: {op} needs the {tag} of its unit, which has not been issued; validate "
                "the schedule first"
            )
        return found

    def _collective(self, rank: int, comm: str, op: Op, position: int, what: str = "") -> CommOp:
        return CommOp(rank, comm, "collective", what or format_op(op), op, position)

    # ---- the main thread (executor._StepRun.execute) ---------------------------------------

    def _main(self, thread: Thread) -> Program:
        rank = thread.rank
        ops = self.schedule.ranks[rank]
        runs = _batches(ops) if self.batch else {p: [p] for p, op in enumerate(ops) if op.is_comm}
        sent: list[Unit] = []
        for position, op in enumerate(ops):
            thread.position, thread.op = position, op
            if op.kind in COMM_KINDS:
                if position in runs:
                    yield from self._p2p(thread, runs[position], sent)
            elif op.is_collective:
                yield from self._issue(thread, op, position)
            elif op.kind == OpKind.S:
                self.replay.stream_wait(rank, self._vocab_unit(rank, "BCAST_X", op))
            elif op.kind == OpKind.T:
                yield from self._settle_reduce_s(thread, op)
            elif op.is_compute:
                yield from self._compute(thread, op, position)
            for source, heavy in self.serves.get((rank, op), []):  # a light op (any kind)
                yield from self._serve(thread, op, position, source, heavy)
        thread.phase = "the end-of-step flush"
        for unit in sent:
            if not unit.done:
                first = unit.first_open()
                thread.position, thread.op = first.position, first.source
                yield ("unit", unit)
        if self.chain is not None:
            thread.phase = "optimizer post-validation"
            yield from self._post_validation(thread)

    def _p2p(self, thread: Thread, positions: list[int], sent: list[Unit]) -> Program:
        rank = thread.rank
        ops: list[CommOp] = []
        for position in positions:
            op = self.schedule.ranks[rank][position]
            assert op.peer is not None
            sending = op.kind in SENDS
            direction = "F" if op.kind in (OpKind.SEND_F, OpKind.RECV_F) else "B"
            sender, receiver = (rank, op.peer) if sending else (op.peer, rank)
            comm = self.replay.comm(p2p_channel(sender, receiver, direction, self.batch), (rank, op.peer))
            role = "send" if sending else "recv"
            ops.append(CommOp(rank, comm, role, format_op(op), op, position, op.peer))
        unit = yield from self._launch(thread, ops)
        for op in ops:
            if op.role == "recv":  # posted here; the op that consumes the message waits for it
                self.received[(rank, *simulate_message_key(op.source))] = (unit, op)
        if all(op.role == "send" for op in ops):
            sent.append(unit)

    def _issue(self, thread: Thread, op: Op, position: int) -> Program:
        """A vocabulary collective: issued asynchronously (``vocab_ops.VocabStep``)."""
        rank = thread.rank
        if op.kind == OpKind.REDUCE_EMB:  # the lookup waits (stream) for the token ids
            self.replay.stream_wait(rank, self._vocab_unit(rank, "BCAST_IDS", op))
        unit = yield from self._launch(thread, [self._collective(rank, VOCAB_GROUPS[op.kind], op, position)])
        self.vocab[(rank, op.kind.value, op.microbatch, op.slice)] = unit
        if op.kind == OpKind.REDUCE_S and self.variant == "vocab-2":
            self.replay.signal(("issued", rank, op.microbatch, op.slice))

    def _settle_reduce_s(self, thread: Thread, op: Op) -> Program:
        """T (and the loss rank's last backward under vocab-2) settles REDUCE_S: a stream wait
        for the all-gather (vocab-1), a host wait for the worker's chain (vocab-2)."""
        rank = thread.rank
        if self.variant == "vocab-2":
            key = ("reduced", rank, op.microbatch, op.slice)
            if key not in self.replay.signals:
                yield ("signal", key)
        else:
            self.replay.stream_wait(rank, self._vocab_unit(rank, "REDUCE_S", op))

    def _compute(self, thread: Thread, op: Op, position: int) -> Program:
        rank = thread.rank
        lay = self.layout
        direction = "F" if op.kind == OpKind.F else "B" if op.kind in BACKWARD_KINDS else None
        posted = self.received.pop((rank, direction, *op.unit), None) if direction else None
        if posted is not None:  # the host waits for its input (p2p.PendingRecv.wait)
            unit, recv = posted
            thread.position, thread.op = recv.position, recv.source
            yield from self._wait(thread, unit)
            thread.position, thread.op = position, op
        if self.variant != "none":
            if op.kind == OpKind.F and op.stage == 0 and rank == lay.first_rank:
                self.replay.stream_wait(rank, self._vocab_unit(rank, "REDUCE_EMB", op))
            if op.kind in BACKWARD_KINDS and op.stage == lay.last_stage and rank == lay.loss_rank:
                if self.variant == "vocab-1":
                    self.replay.stream_wait(rank, self._vocab_unit(rank, "REDUCE_T", op))
                else:
                    yield from self._settle_reduce_s(thread, op)
                    self.replay.stream_wait(rank, self._vocab_unit(rank, "OUT", op))
        partner = self.delegated.get((rank, op))
        if partner is not None:
            yield from self._delegate(thread, op, position, partner)

    # ---- SlimPipe's attention redistribution (runtime/redistribution.py) -------------------

    def _delegate(self, thread: Thread, op: Op, position: int, partner: int) -> Program:
        """The heavy op: header and request out, the answer back (``_Request.wait``), DONE."""
        rank = thread.rank
        comm = self.replay.comm(attention_channel(rank, partner), (rank, partner))
        name = format_op(op)
        header = CommOp(rank, comm, "send", f"attention header of {name}", op, position, partner, True)
        payload = CommOp(rank, comm, "send", f"attention request of {name} (Q, K, V)", op, position, partner)
        answer = CommOp(rank, comm, "recv", f"attention answer for {name}", op, position, partner)
        units = []
        for item in (header, payload, answer):
            units.append((yield from self._launch(thread, [item])))
        for unit in reversed(units):  # the answer, then the sends
            yield from self._wait(thread, unit)
        done = CommOp(rank, comm, "send", f"attention DONE after {name}", op, position, partner, True)
        yield from self._wait(thread, (yield from self._launch(thread, [done])))

    def _serve(self, thread: Thread, op: Op, position: int, source: int, heavy: Op) -> Program:
        """The light op serves the heavy op of its slot: header, request, answer, then DONE."""
        rank = thread.rank
        comm = self.replay.comm(attention_channel(source, rank), (source, rank))
        name = f"rank {source}'s {format_op(heavy)}"
        steps = (
            ("recv", f"attention header of {name}"),
            ("recv", f"attention request of {name}"),
            ("send", f"attention answer for {name}"),
            ("recv", f"attention DONE after {name}"),
        )
        for role, what in steps:
            item = CommOp(rank, comm, role, what, op, position, source)
            yield from self._wait(thread, (yield from self._launch(thread, [item])))

    # ---- optimizer post-validation (megatron/post_validation.PostValidation.begin) ----------

    def _post_validation(self, thread: Thread) -> Program:
        """The global all-reduce launched, the partial state received from the previous rank of
        the chain (waited for) and sent to the next (not waited for: the next step's gate does)."""
        rank = thread.rank
        assert self.chain is not None
        place = self.chain.index(rank)
        reduce = CommOp(rank, POST_VALIDATION_GROUP, "collective", "post-validation all-reduce")
        yield from self._launch(thread, [reduce])
        if place > 0:
            source = self.chain[place - 1]
            comm = self.replay.comm(post_validation_pair(source, rank), (source, rank))
            what = f"post-validation partial state from rank {source}"
            item = CommOp(rank, comm, "recv", what, peer=source)
            yield from self._wait(thread, (yield from self._launch(thread, [item])))
        if place + 1 < len(self.chain):
            target = self.chain[place + 1]
            comm = self.replay.comm(post_validation_pair(rank, target), (rank, target))
            what = f"post-validation partial state to rank {target}"
            yield from self._launch(thread, [CommOp(rank, comm, "send", what, peer=target, eager=True)])

    # ---- vocab-2's REDUCE_S worker (vocab_parallel.VocabParallel._reduce_input_grad) -------

    def _worker(self, thread: Thread) -> Program:
        rank = thread.rank
        for position, op in enumerate(self.schedule.ranks[rank]):
            if op.kind != OpKind.REDUCE_S:
                continue
            key = (rank, op.microbatch, op.slice)
            if ("issued", *key) not in self.replay.signals:
                thread.position, thread.op = -1, op
                yield ("signal", ("issued", *key))
            thread.position, thread.op = position, op
            self.replay.stream_wait(rank, self._vocab_unit(rank, "REDUCE_S", op))
            what = f"{format_op(op)} (the worker's reduce)"
            unit = yield from self._launch(thread, [self._collective(rank, WORKER_GROUP, op, position, what)])
            self.vocab[(rank, "OUT", op.microbatch, op.slice)] = unit
            self.replay.stream_wait(rank, unit)
            self.replay.signal(("reduced", *key))

    # ---- explaining a hang -------------------------------------------------------------------

    def explain(self, stuck: list[Thread]) -> Hang:
        waits = tuple(
            f"rank {t.rank}{'' if t.name == 'main' else f' ({t.name})'} {self._doing(t)}" for t in stuck
        )
        first = min(stuck, key=lambda t: (t.name != "main", t.rank, t.position))
        return self._hang(first, waits)

    def left_over(self, unit: Unit) -> Hang:
        """Every thread finished but ``unit`` never completes: it would block the next step."""
        op = unit.first_open()
        channel, peers, reason, fix = self._blocked(op)
        reason += f" (rank {unit.rank} has finished its ops: the next step would wait behind it)"
        return Hang(unit.rank, op.position, op.source, channel, peers, reason, fix)

    def _at(self, thread: Thread) -> str:
        text = "the start of the step" if thread.op is None else format_op(thread.op)
        if thread.position >= 0:
            text += f" (position {thread.position})"
        return text + (f" in {thread.phase}" if thread.phase else "")

    def _doing(self, thread: Thread) -> str:
        """What a stuck thread does, in a few words."""
        if thread.finished or thread.waiting is None:
            return "has finished the step"
        what, subject = thread.waiting
        if what == "created":
            return f"is creating communicator {subject} at {self._at(thread)}"
        if what == "unit":
            op = subject.first_open()
            if op.source == thread.op and op.position == thread.position:
                return f"waits at {self._at(thread)} on {op.comm}"
            return f"waits at {self._at(thread)} for {op.what} on {op.comm}"
        if what == "signal":
            return f"waits at {self._at(thread)} for its vocab-2 worker's REDUCE_S"
        return f"waits at {self._at(thread)} for its {subject.name}"

    def _rank_doing(self, rank: int) -> str:
        main = self.mains[rank]
        if main.finished:
            helpers = [t for t in self.replay.threads if t.rank == rank and not t.finished]
            return self._doing(helpers[0]) if helpers else "has finished the step"
        return self._doing(main)

    def _which(self, peers: tuple[int, ...], shown: int = 3) -> str:
        """What the peers do: "which ..." for one, "rank a ...; rank b ..." for several (the first
        ``shown`` of them, so that the message stays one readable line)."""
        if len(peers) == 1:
            return f"which {self._rank_doing(peers[0])}"
        text = "; ".join(f"rank {peer} {self._rank_doing(peer)}" for peer in peers[:shown])
        return text + (f"; and {len(peers) - shown} more ranks" if len(peers) > shown else "")

    def _hang(self, thread: Thread, waits: tuple[str, ...]) -> Hang:
        assert thread.waiting is not None
        what, subject = thread.waiting
        rank, position, op = thread.rank, thread.position, thread.op
        if what == "created":
            missing = tuple(r for r in self.replay.members[subject] if r not in self.replay.arrived[subject])
            reason = (
                f"{self._which(missing)}; creating {subject} blocks rank {rank} until every member "
                "reaches its first use of it (lazy creation)"
            )
            return Hang(rank, position, op, subject, missing, reason, FIX_CREATION, waits)
        if what == "unit":
            comm_op = subject.first_open()
            channel, peers, reason, fix = self._blocked(comm_op)
            if thread.phase:
                reason += f" (rank {rank} is in {thread.phase})"
            return Hang(rank, comm_op.position, comm_op.source, channel, peers, reason, fix, waits)
        if what == "signal" and subject[0] == "issued":  # cannot happen for a valid schedule
            reason = "the main thread never issues this REDUCE_S"
            return Hang(rank, position, op, WORKER_GROUP, (), reason, FIX_COLLECTIVE, waits)
        helper = subject if what == "thread" else self._worker_of(rank)
        inner = self._hang(helper, waits)
        reason = f"{inner.reason} (rank {rank} waits for its {helper.name}, which {self._doing(helper)})"
        return Hang(rank, position, op, inner.channel, inner.peers, reason, inner.fix, waits)

    def _worker_of(self, rank: int) -> Thread:
        return next(t for t in self.replay.threads if t.rank == rank and t.name == "vocab-2 worker")

    def _blocked(self, op: CommOp) -> tuple[str, tuple[int, ...], str, str]:
        """(channel, peers, reason, fix) for a launched operation that cannot complete."""
        replay = self.replay
        assert op.unit is not None
        ahead = replay.ahead(op.unit)
        if ahead is not None:
            head = ahead.first_open()
            peers = self._waits_on(head)
            reason = (
                f"{self._which(peers)}; {op.what} is queued behind {head.what} ({head.comm}), launched "
                f"earlier, and {self._rule(head.comm)}"
            )
            return op.comm, peers, reason, FIX_ORDER
        dep = replay.pending_dep(op.unit)
        if dep is not None:
            head = dep.first_open()
            peers = self._waits_on(head)
            reason = (
                f"{self._which(peers)}; {op.what} runs after {head.what} ({head.comm}): a stream dependency"
            )
            return op.comm, peers, reason, FIX_ORDER
        missing = tuple(replay.missing(op))
        if missing:
            kind = "collective" if op.role == "collective" else ("receive" if op.role == "send" else "send")
            reason = f"{self._which(missing)}; the matching {kind} is not posted yet"
            if op.role == "send":
                reason += " and a large send completes only with its receive"
            fix = FIX_COLLECTIVE if op.role == "collective" else FIX_RENDEZVOUS
            return op.comm, missing, reason, fix
        late = [other for other in replay.partners(op)[1:] if not replay.running(other.unit)]  # type: ignore[arg-type]
        peers = tuple(sorted({other.rank for other in late}))
        parts = []
        for other in late:
            head = replay.ahead(other.unit).first_open()  # type: ignore[arg-type, union-attr]
            parts.append(f"rank {other.rank} posted {other.what} behind {head.what} ({head.comm})")
        rule = self._rule(op.comm)
        reason = f"{self._which(peers)}; " + "; ".join(parts) + f", launched earlier there, and {rule}"
        return op.comm, peers, reason, FIX_ORDER

    def _rule(self, comm: str) -> str:
        if self.replay.strict:
            return "one GPU completes its communication in launch order"
        return f"{comm} completes its operations in order"

    def _waits_on(self, op: CommOp) -> tuple[int, ...]:
        """The ranks an operation at the head of its queue waits for."""
        missing = self.replay.missing(op)
        if missing:
            return tuple(missing)
        others = [other.rank for other in self.replay.partners(op)[1:] if not other.done]
        return tuple(sorted(set(others))) or (op.rank,)
