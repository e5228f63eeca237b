"""SlimPipe's attention workload redistribution on real ranks.

``schedule/redistribute.py`` plans it: at every lock-step slot the heavy op of a pair hands the
attention of its queries to its oldest K/V slices to the light op's rank. This module carries
the plan out:

* :class:`Redistribution` (one per runtime) turns a schedule and its slice lengths into the plan
  and creates one process group per ordered pair (delegating rank, partner) that the plan uses,
  collectively and in sorted order on every rank (they all compute the same plan).
* :class:`StepRedistribution` (one per step) starts a service THREAD per rank that delegates to
  this one. The thread receives a small header (kind and shapes; STOP ends it), then the
  tensors, computes the non-causal partial attention with the kernel the header names (forward:
  ``(out, lse)``; backward, given dout and the merged out/lse: ``(dq, dk, dv)``) and sends the
  result back. It keeps nothing between requests, so forward and backward may go to different
  partners. Around each F/B/BW op the executor sets the chunk's ``SliceContext
  .current_delegation`` to a :class:`PartnerAttention`, which sliced attention calls (it
  overlaps the partner's work with its own local blocks).

Each pair's group is used by exactly one thread on each side (the delegating rank's main thread,
the partner's service thread for it), so no group is shared between threads, as NCCL wants; on
gloo it is simply one channel per direction of delegation. Every receive has the runtime's
deadline (``p2p.PipeComm``): a dead peer gives a :class:`PeerError` naming the rank, the op and
the peer. A rank sends STOP to a partner right after its last op that delegates to it in the
step (at once if the step has none), so a service thread never idles through the rest of a step;
threads are joined at step end and their errors raised there, naming both ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import SliceContext, SlicedCoreAttention
from ..attention.backends import KERNEL_NAMES, kernel_named
from ..attention.math_kernel import compute_dtype
from ..attention.remote import serve_backward, serve_forward
from ..schedule.ir import Op, Schedule
from ..schedule.redistribute import Delegation, check_cap, delegation_plan, plan_links
from .p2p import PeerError, PipeComm

STOP, FORWARD, BACKWARD = 0, 1, 2
HEADER = 11  # kind, kernel, dtype, b, h, sq, g, nk, d, dv, scale
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
Plan = dict[tuple[int, Op], Delegation]
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass
class AttentionCounts:
    """Attention of one rank in one step, in query-key pairs x passes (forward 1, backward 2)
    x sequences, summed over layers. ``own``: computed here for this rank's ops; ``delegated``:
    handed to partners by this rank's ops; ``served``: computed here for each source rank."""

    own: dict[Op, int] = field(default_factory=dict)
    delegated: dict[Op, int] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)

    def totals(self) -> tuple[int, int, int]:
        """(own, served, delegated) summed over the step."""
        return sum(self.own.values()), sum(self.served.values()), sum(self.delegated.values())


# ---- one ordered pair's group, seen from one side -------------------------------------------


class _Channel:
    def __init__(self, comm: PipeComm, group: Any, peer: int, device: torch.device) -> None:
        self.comm = comm
        self.group = group
        self.peer = peer
        self.device = device

    def _start(self, op: Any, buffer: Tensor, what: str) -> tuple[Any, Tensor]:
        try:
            peer = self.comm.ranks[self.peer]
            name = f"{what} rank {self.peer}"  # "attention request from rank 1"
            return self.comm.launch(lambda: op(buffer, peer, group=self.group), name), buffer
        except RuntimeError as error:
            raise PeerError(f"rank {self.comm.rank}: {what} rank {self.peer} failed: {error}") from error

    def send(self, tensors: Sequence[Tensor], what: str) -> list[tuple[Any, Tensor]]:
        """Start sending ``tensors`` (NCCL sends device tensors, gloo host ones: PipeComm.wire_device)."""
        wire = self.comm.wire_device(self.device)
        return [self._start(dist.isend, t.detach().to(wire).contiguous(), f"{what} to") for t in tensors]

    def post(self, specs: Sequence[Spec], what: str) -> list[tuple[Any, Tensor]]:
        """Post the receives of ``specs`` (shape, dtype) and return them in flight."""
        wire = self.comm.wire_device(self.device)
        return [
            self._start(dist.irecv, torch.empty(shape, dtype=dtype, device=wire), f"{what} from")
            for shape, dtype in specs
        ]

    def wait(self, works: Sequence[tuple[Any, Tensor]], what: str) -> list[Tensor]:
        """Wait for each transfer within the runtime's timeout; PeerError names rank and peer."""
        for work, _ in works:
            self.comm.wait_work(work, what, self.peer)
        return [buffer for _, buffer in works]

    def received(self, works: Sequence[tuple[Any, Tensor]], what: str) -> list[Tensor]:
        """Wait for posted receives; their tensors on this rank's device."""
        return [buffer.to(self.device) for buffer in self.wait(works, what)]

    def recv(self, specs: Sequence[Spec], what: str) -> list[Tensor]:
        return self.received(self.post(specs, what), f"{what} from")


def _header(
    kind: int, kernel: str = "math", q: Tensor | None = None, v: Tensor | None = None, scale: float = 0.0
) -> Tensor:
    """The request's kind and, for a forward or backward, what the partner must allocate."""
    values = [float(kind)] + [0.0] * (HEADER - 1)
    if q is not None and v is not None:
        b, h, sq, d = q.shape
        values[1:] = [
            KERNEL_NAMES.index(kernel), DTYPES.index(q.dtype), b, h, sq, v.shape[1], v.shape[2], d,
            v.shape[3], scale,
        ]  # fmt: skip
    return torch.tensor(values, dtype=torch.float64)


@dataclass(frozen=True)
class _Shapes:
    """What a header says about a request's tensors."""

    kernel: str
    dtype: torch.dtype
    q: tuple[int, ...]
    kv: tuple[int, ...]
    v: tuple[int, ...]
    out: tuple[int, ...]
    lse: tuple[int, ...]
    scale: float

    @classmethod
    def read(cls, header: Tensor) -> _Shapes:
        kernel, dtype, b, h, sq, g, nk, d, dv = (int(x) for x in header[1:10].tolist())
        return cls(
            KERNEL_NAMES[kernel], DTYPES[dtype], (b, h, sq, d), (b, g, nk, d), (b, g, nk, dv),
            (b, h, sq, dv), (b, h, sq), float(header[10]),
        )  # fmt: skip

    @property
    def lse_dtype(self) -> torch.dtype:
        return compute_dtype(self.dtype)


# ---- the delegating side --------------------------------------------------------------------


class _Request:
    """A request in flight: its sends and the posted receives of the answer."""

    def __init__(self, channel: _Channel, sends: list, answer: list, what: str) -> None:
        self.channel, self.sends, self.answer, self.what = channel, sends, answer, what

    def wait(self) -> tuple[Tensor, ...]:
        comm = self.channel.comm
        start = time.monotonic()
        try:
            result = self.channel.received(self.answer, f"{self.what} from")
            self.channel.wait(self.sends, f"{self.what} to")
        finally:
            comm.wait_seconds += time.monotonic() - start
        return tuple(result)


@dataclass
class PartnerAttention:
    """The running op's delegation, as sliced attention sees it (``attention.remote.RemoteKeys``):
    its ``oldest_slices`` K/V slices are attended on the partner at the other end of ``channel``."""

    channel: _Channel
    oldest_slices: int
    op: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str) -> _Request:
        what = f"attention of {self.op} (oldest {self.oldest_slices} slices, forward)"
        sends = self.channel.send([_header(FORWARD, kernel, q, v, scale), q, k, v], what)
        shapes = [(tuple(q.shape[:3]) + (v.shape[3],), q.dtype), (tuple(q.shape[:3]), compute_dtype(q.dtype))]
        return _Request(self.channel, sends, self.channel.post(shapes, what), what)

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dout: Tensor,
        out: Tensor,
        lse: Tensor,
        scale: float,
        kernel: str,
    ) -> _Request:
        what = f"attention of {self.op} (oldest {self.oldest_slices} slices, backward)"
        tensors = [dout.to(q.dtype), out.to(q.dtype), lse.to(compute_dtype(q.dtype))]
        sends = self.channel.send([_header(BACKWARD, kernel, q, v, scale), q, k, v, *tensors], what)
        shapes = [(tuple(q.shape), q.dtype), (tuple(k.shape), q.dtype), (tuple(v.shape), q.dtype)]
        return _Request(self.channel, sends, self.channel.post(shapes, what), what)

    def stop(self) -> None:
        """Tell the partner's service thread for this rank that the step has no more requests."""
        self.channel.wait(self.channel.send([_header(STOP)], "attention STOP"), "attention STOP to")


# ---- the partner side -----------------------------------------------------------------------


class _Service:
    """Serves one source rank's requests in a thread until its STOP."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.served = 0
        self.requests = 0
        self.error: BaseException | None = None
        name = f"attention-service-{channel.comm.rank}-for-{channel.peer}"
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        device = self.channel.device
        try:
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext(), torch.no_grad():
                while self._serve_one():
                    pass
        except BaseException as error:  # raised in the main thread at step end
            self.error = error

    def _serve_one(self) -> bool:
        what = "attention request"
        (header,) = self.channel.recv([((HEADER,), torch.float64)], what)
        kind = int(header[0])
        if kind == STOP:
            return False
        shapes = _Shapes.read(header)
        kernel = kernel_named(shapes.kernel)
        specs = [(shapes.q, shapes.dtype), (shapes.kv, shapes.dtype), (shapes.v, shapes.dtype)]
        b, h, sq, _ = shapes.q
        pairs = b * sq * shapes.kv[2]
        if kind == FORWARD:
            q, k, v = self.channel.recv(specs, what)
            out, lse = serve_forward(kernel, q, k, v, shapes.scale)
            answer = [out.to(shapes.dtype), lse.to(shapes.lse_dtype)]
            self.served += pairs
        elif kind == BACKWARD:
            specs += [(shapes.out, shapes.dtype), (shapes.out, shapes.dtype), (shapes.lse, shapes.lse_dtype)]
            q, k, v, dout, out, lse = self.channel.recv(specs, what)
            answer = list(serve_backward(kernel, q, k, v, dout, out, lse, shapes.scale))
            self.served += 2 * pairs
        else:
            raise ValueError(f"unknown attention request kind {kind}")
        self.requests += 1
        self.channel.wait(self.channel.send(answer, "attention answer"), "attention answer to")
        return True

    def failure(self) -> str | None:
        """What went wrong in the thread, naming this rank and the source rank (None: nothing)."""
        if self.error is None:
            return None
        return (
            f"rank {self.channel.comm.rank}: the attention service for rank {self.channel.peer} failed "
            f"after {self.requests} requests: {type(self.error).__name__}: {self.error}"
        )

    def check(self) -> None:
        failure = self.failure()
        if failure is not None:
            raise PeerError(failure) from self.error

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise PeerError(
                f"rank {self.channel.comm.rank}: the attention service for rank {self.channel.peer} "
                f"got no STOP within {timeout_s:.1f}s"
            )
        self.check()


# ---- per runtime and per step ---------------------------------------------------------------


class Redistribution:
    """The plan of each schedule and the process groups of the pairs it uses (one per runtime).

    Planning is collective: every pipeline rank must reach :meth:`plan` for the same schedule and
    slice lengths together (the runtime calls it at the start of a step)."""

    def __init__(self, comm: PipeComm, cap: float, chunks: Sequence[torch.nn.Module]) -> None:
        check_cap(cap)
        self.comm = comm
        self.cap = cap
        self.chunks = list(chunks)
        self._groups: dict[tuple[int, int], Any] = {}
        self._plans: dict[tuple[str, tuple[int, ...]], Plan] = {}
        self._layers: dict[int, int] | None = None  # stage -> attention layers, all ranks
        self._plan_group: Any = None
        if cap:
            _check_kernels(self.chunks)

    def plan(self, schedule: Schedule, lengths: Sequence[int]) -> Plan:
        """The delegations of ``schedule`` cut into ``lengths`` (empty with cap 0)."""
        if not self.cap:
            return {}
        key = (schedule.to_json(), tuple(lengths))
        if key not in self._plans:
            layers = self._layers_per_stage(schedule)
            plan = delegation_plan(schedule, lengths, self.cap, layers)
            for link in plan_links(plan):
                if link not in self._groups:
                    self._groups[link] = self.comm.new_group(sorted(link))
            self._plans[key] = plan
        return self._plans[key]

    def _layers_per_stage(self, schedule: Schedule) -> list[int]:
        """Attention layers of every stage, gathered once from the ranks that hold them."""
        if self._layers is None:
            stages = schedule.placement.stages_of(self.comm.rank)
            mine = {stage: _attention_layers(chunk) for stage, chunk in zip(stages, self.chunks)}
            if self._plan_group is None:
                self._plan_group = self.comm.new_group(range(self.comm.size))
            gathered: list[Any] = [None] * self.comm.size
            dist.all_gather_object(gathered, mine, group=self._plan_group)
            self._layers = {stage: count for part in gathered for stage, count in part.items()}
        return [self._layers.get(stage, 0) for stage in range(schedule.num_stages)]

    def links(self) -> dict[tuple[int, int], Any]:
        """(source, partner) pipeline ranks -> the group of their link, for the plans made so far."""
        return dict(self._groups)

    def begin(
        self, plan: Plan, ops: Sequence[Op], contexts: Sequence[SliceContext], placement: Any
    ) -> StepRedistribution:
        return StepRedistribution(self, plan, ops, contexts, placement)

    def channel(self, source: int, partner: int, peer: int, device: torch.device) -> _Channel:
        return _Channel(self.comm, self._groups[(source, partner)], peer, device)


class StepRedistribution:
    """One step on one rank: the service threads for the ranks that delegate here, the
    delegations of this rank's ops, STOPs, and the counts."""

    def __init__(
        self,
        owner: Redistribution,
        plan: Plan,
        ops: Sequence[Op],
        contexts: Sequence[SliceContext],
        placement: Any,
    ) -> None:
        self.comm = owner.comm
        self.contexts = list(contexts)
        self.counts = AttentionCounts()
        rank = self.comm.rank
        device = _device(owner.chunks)
        self.services = {
            source: _Service(owner.channel(source, rank, source, device))
            for source, partner in plan_links(plan)
            if partner == rank
        }
        self.partners = {
            partner: owner.channel(rank, partner, partner, device)
            for source, partner in plan_links(plan)
            if source == rank
        }
        self.delegations = {op: d for (r, op), d in plan.items() if r == rank}
        self._last_use: dict[Op, list[int]] = {}  # op -> partners whose last request it is
        last: dict[int, Op] = {}
        for op in ops:
            if op in self.delegations:
                last[self.delegations[op].partner] = op
        for partner, op in last.items():
            self._last_use.setdefault(op, []).append(partner)
        self._unused = [partner for partner in self.partners if partner not in last]
        stages = placement.stages_of(rank)
        for index, context in enumerate(self.contexts):
            context.delegating = any(op.stage == stages[index] for op in self.delegations)
        self._stopped: set[int] = set()

    def start(self) -> None:
        """First thing in the step: STOP the partners that no op of this step delegates to
        (a forward-only pass whose delegations are all backward ones)."""
        for partner in self._unused:
            self._stop(partner)

    @contextmanager
    def running(self, chunk_index: int, op: Op) -> Iterator[None]:
        """Around an F/B/BW op: the chunk's delegation for it, and its attention counted."""
        context = self.contexts[chunk_index]
        delegation = self.delegations.get(op)
        if delegation is not None:
            channel = self.partners[delegation.partner]
            context.current_delegation = PartnerAttention(channel, delegation.oldest_slices, str(op))
        local, remote = context.pairs_local, context.pairs_remote
        try:
            yield
        finally:
            context.current_delegation = None
        self.counts.own[op] = self.counts.own.get(op, 0) + context.pairs_local - local
        if context.pairs_remote > remote:
            self.counts.delegated[op] = self.counts.delegated.get(op, 0) + context.pairs_remote - remote
        for partner in self._last_use.get(op, []):
            self._stop(partner)
        for service in self.services.values():
            service.check()  # a failed service thread stops the step at the next op

    def _stop(self, partner: int) -> None:
        if partner not in self._stopped:
            self._stopped.add(partner)
            PartnerAttention(self.partners[partner], 0, "STOP").stop()

    def finish(self) -> AttentionCounts:
        """STOP every partner not stopped yet, join the service threads, raise their errors."""
        for partner in self.partners:
            self._stop(partner)
        for source, service in self.services.items():
            service.join(self.comm.timeout_s + 5.0)
            self.counts.served[source] = service.served
        return self.counts

    def abandon(self) -> str | None:
        """After a failed step: no delegation stays set (service threads end at their timeout).
        Returns what a failed service thread reported, which may be why the step failed."""
        for context in self.contexts:
            context.current_delegation = None
            context.delegating = False
        failures = [f for f in (s.failure() for s in self.services.values()) if f is not None]
        return "; ".join(failures) or None


def _device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    return next(chunks[0].parameters()).device


def _attention_layers(chunk: torch.nn.Module) -> int:
    return sum(isinstance(module, SlicedCoreAttention) for module in chunk.modules())


def _check_kernels(chunks: Sequence[torch.nn.Module]) -> None:
    """Partners run the kernel's own backward on their block: autograd-only backends cannot."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, SlicedCoreAttention) and module.backend in ("sdpa", "flex"):
                raise ValueError(
                    f"--pp-attn-redistribution needs attention kernels with an explicit backward "
                    f"({', '.join(KERNEL_NAMES)} or auto), but layer {module.layer_number} uses "
                    f"{module.backend!r}; set --pp-attn-redistribution 0 or change the backend"
                )
