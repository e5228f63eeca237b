"""The engine behind ``nccl_check.py``: host threads that launch communication, and NCCL's rules
for when it completes.

Each rank has host threads (the executor's main thread and its helpers) whose programs are
generators: they launch *units* of communication and yield a condition whenever the host would
block (a communicator being created, a unit to complete, a signal from another thread of the
rank). The engine resumes a thread once its condition holds and completes units by NCCL's rules:

* lazy creation (unless ``warmed``): the first use of a communicator on a rank blocks that thread
  until every member rank has reached its own first use;
* a large send completes only together with its receive (rendezvous); a small (eager) send
  completes on its own and its receive once it has been sent; a collective completes when all
  its members take part;
* a unit runs only at the head of its queue: one queue per rank under ``strict`` (one GPU
  completes its communication in launch order), else one per rank and communicator. A unit of
  several operations is one ``batch_isend_irecv``: it runs as a whole, its operations complete
  one by one. Outside ``strict`` a unit also waits for what the compute stream had waited for
  when it was launched (its stream dependencies).

Pure Python, like the rest of the schedule core.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

Condition = tuple[Any, ...]  # ("created", comm) | ("unit", Unit) | ("signal", key) | ("thread", Thread)
Program = Generator[Condition, None, None]


@dataclass(eq=False)
class CommOp:
    """One operation of one rank on one communicator. ``role``: send, recv or collective;
    ``source`` and ``position``: the schedule op it carries out and its place, for messages."""

    rank: int
    comm: str
    role: str
    what: str
    source: Any = None
    position: int = -1
    peer: int | None = None
    eager: bool = False
    index: int = -1  # its place among the operations it is matched with
    unit: Unit | None = None
    done: bool = False


@dataclass(eq=False)
class Unit:
    """What one launch puts on a rank's queue: one operation, or a batch of them."""

    rank: int
    ops: list[CommOp]
    deps: int  # how much of the rank's stream frontier it waits for (outside strict)
    done: bool = False

    @property
    def comms(self) -> list[str]:
        return list(dict.fromkeys(op.comm for op in self.ops))

    def first_open(self) -> CommOp:
        return next(op for op in self.ops if not op.done)


@dataclass(eq=False)
class Thread:
    """A host thread of one rank; ``position``/``op``/``phase`` say where it is, for messages."""

    rank: int
    name: str
    program: Program | None = None
    waiting: Condition | None = None
    position: int = -1
    op: Any = None
    phase: str = ""
    finished: bool = False


@dataclass
class Replay:
    """The state of one replay: communicators, queues, matching slots and threads."""

    pp: int
    strict: bool
    warmed: bool
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    threads: list[Thread] = field(default_factory=list)
    signals: set[Any] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.arrived: dict[str, set[int]] = defaultdict(set)
        self.created: set[str] = set()
        self.waiters: dict[Any, list[Thread]] = defaultdict(list)
        self.queues: dict[Any, deque[Unit]] = defaultdict(deque)
        self.frontier: list[list[Unit]] = [[] for _ in range(self.pp)]
        self.frontier_done = [0] * self.pp
        self.sends: dict[tuple[str, int, int], list[CommOp]] = defaultdict(list)
        self.recvs: dict[tuple[str, int, int], list[CommOp]] = defaultdict(list)
        self.collectives: dict[str, list[dict[int, CommOp]]] = defaultdict(list)
        self.issued: dict[tuple[str, int], int] = defaultdict(int)
        self.candidates: deque[CommOp] = deque()
        self.on_deps: dict[int, list[CommOp]] = defaultdict(list)
        self.ready: deque[Thread] = deque()
        self.units: list[Unit] = []

    # ---- what programs call ----------------------------------------------------------------

    def comm(self, name: str, members: Iterable[int]) -> str:
        self.members.setdefault(name, tuple(sorted(members)))
        return name

    def create(self, thread: Thread, comms: Iterable[str]) -> Program:
        """Block ``thread`` until each of ``comms`` exists (lazy creation)."""
        for name in comms:
            if not self.warmed and name not in self.created:
                yield ("created", name)

    def launch(self, rank: int, ops: list[CommOp]) -> Unit:
        unit = Unit(rank, ops, len(self.frontier[rank]))
        self.units.append(unit)
        for op in ops:
            op.unit = unit
            self._slot(op)
        for key in self._queue_keys(unit):
            self.queues[key].append(unit)
        if self.running(unit):
            self.candidates.extend(ops)
        return unit

    def stream_wait(self, rank: int, unit: Unit) -> None:
        """The rank's compute stream waits for ``unit``: later launches depend on it."""
        self.frontier[rank].append(unit)

    def signal(self, key: Any) -> None:
        """Set ``key`` and run the threads waiting for it at once (helpers react quickly)."""
        self.signals.add(key)
        for thread in self.waiters.pop(("signal", key), []):
            self._resume(thread)

    def start(self, thread: Thread, program: Program) -> Thread:
        thread.program = program
        self.threads.append(thread)
        return thread

    # ---- the replay ------------------------------------------------------------------------

    def run(self) -> list[Thread]:
        """Run until nothing moves; return the threads that did not finish."""
        self.ready.extend(self.threads)
        while self.ready or self.candidates:
            while self.ready:
                self._resume(self.ready.popleft())
            while self.candidates:
                self._check(self.candidates.popleft())
        return [thread for thread in self.threads if not thread.finished]

    def left_over(self) -> Unit | None:
        """A unit launched but never completed (once every thread has finished)."""
        return next((unit for unit in self.units if not unit.done), None)

    def _resume(self, thread: Thread) -> None:
        assert thread.program is not None
        while not thread.finished:
            if thread.waiting is not None:
                if not self._holds(thread.waiting, thread.rank):
                    self.waiters[thread.waiting].append(thread)
                    return
                thread.waiting = None
            try:
                thread.waiting = next(thread.program)
            except StopIteration:
                thread.finished = True
                self._wake(("thread", thread))

    def _holds(self, condition: Condition, rank: int) -> bool:
        what, subject = condition
        if what == "created":
            self.arrived[subject].add(rank)
            if subject not in self.created and len(self.arrived[subject]) == len(self.members[subject]):
                self.created.add(subject)
                self._wake(condition)
            return subject in self.created
        if what == "unit":
            return subject.done
        if what == "signal":
            return subject in self.signals
        return subject.finished

    def _wake(self, condition: Condition) -> None:
        self.ready.extend(self.waiters.pop(condition, []))

    # ---- matching and completion -----------------------------------------------------------

    def _slot(self, op: CommOp) -> None:
        if op.role == "collective":
            key = (op.comm, op.rank)
            op.index = self.issued[key]
            self.issued[key] += 1
            slots = self.collectives[op.comm]
            while len(slots) <= op.index:
                slots.append({})
            slots[op.index][op.rank] = op
            return
        assert op.peer is not None
        table = self.sends if op.role == "send" else self.recvs
        key = (op.comm, op.rank, op.peer) if op.role == "send" else (op.comm, op.peer, op.rank)
        op.index = len(table[key])
        table[key].append(op)

    def partners(self, op: CommOp) -> list[CommOp]:
        """The operations launched so far that complete together with ``op`` (``op`` first)."""
        if op.role == "collective":
            slot = self.collectives[op.comm][op.index]
            return [op] + [other for rank, other in sorted(slot.items()) if other is not op]
        table = self.recvs if op.role == "send" else self.sends
        key = (op.comm, op.rank, op.peer) if op.role == "send" else (op.comm, op.peer, op.rank)
        found = table.get(key, [])
        return [op] + ([found[op.index]] if op.index < len(found) else [])

    def missing(self, op: CommOp) -> list[int]:
        """Ranks that have not launched their part of ``op`` yet."""
        if op.role == "collective":
            slot = self.collectives[op.comm][op.index]
            return [rank for rank in self.members[op.comm] if rank not in slot]
        return [] if len(self.partners(op)) == 2 else [op.peer]  # type: ignore[list-item]

    def _queue_keys(self, unit: Unit) -> list[Any]:
        return [unit.rank] if self.strict else [(unit.rank, comm) for comm in unit.comms]

    def ahead(self, unit: Unit) -> Unit | None:
        """The unit in front of ``unit`` in one of its queues (None: it runs)."""
        for key in self._queue_keys(unit):
            head = self.queues[key][0]
            if head is not unit:
                return head
        return None

    def running(self, unit: Unit) -> bool:
        return self.ahead(unit) is None

    def pending_dep(self, unit: Unit) -> Unit | None:
        """The first stream dependency of ``unit`` not complete yet (never under strict)."""
        if self.strict:
            return None
        chain, done = self.frontier[unit.rank], self.frontier_done[unit.rank]
        while done < len(chain) and chain[done].done:
            done += 1
        self.frontier_done[unit.rank] = done
        if done >= unit.deps:
            return None
        return next(dep for dep in chain[done : unit.deps] if not dep.done)

    def _can_run(self, unit: Unit, asking: CommOp) -> bool:
        if not self.running(unit):
            return False
        if self.pending_dep(unit) is not None:
            self.on_deps[unit.rank].append(asking)
            return False
        return True

    def _check(self, op: CommOp) -> None:
        assert op.unit is not None
        if op.done or not self._can_run(op.unit, op):
            return
        if op.role == "send" and op.eager:
            self._finish([op])
            self.candidates.extend(self.partners(op)[1:])
            return
        group = self.partners(op)
        if self.missing(op):
            return
        if op.role == "recv" and group[1].eager:
            if group[1].done:
                self._finish([op])
            return
        if all(self._can_run(other.unit, op) for other in group[1:]):  # type: ignore[arg-type]
            self._finish(group)

    def _finish(self, ops: list[CommOp]) -> None:
        for op in ops:
            op.done = True
        for op in ops:
            unit = op.unit
            assert unit is not None
            if unit.done or any(not other.done for other in unit.ops):
                continue
            unit.done = True
            for key in self._queue_keys(unit):
                queue = self.queues[key]
                queue.popleft()
                if queue and self.running(queue[0]):
                    self.candidates.extend(queue[0].ops)
            self._wake(("unit", unit))
            self.candidates.extend(self.on_deps.pop(unit.rank, []))
