"""SlimPipe's attention workload redistribution on real ranks.

``schedule/redistribute.py`` plans it: at every lock-step slot the heavy op of a pair hands the
attention of its queries to its oldest K/V slices to the light op's rank. This module carries
the plan out:

* :class:`Redistribution` (one per runtime) turns a schedule and its slice lengths into the plan
  and creates one process group per ordered pair (delegating rank, partner) that the plan uses,
  collectively and in sorted order on every rank (they all compute the same plan).
* :class:`StepRedistribution` (one per step) runs both sides of each pair on the ranks' main
  threads. Around the heavy op the chunk's ``SliceContext.current_delegation`` is a
  :class:`PartnerAttention`, which sliced attention calls at every layer: it sends a small
  header (kind and shapes) and the tensors, runs its own local blocks meanwhile and waits for the
  answer (forward: ``(out, lse)``; backward, given dout and the merged out/lse: ``(dq, dk, dv)``);
  after the op it sends DONE. Around the light op of the same slot the chunk's
  ``current_service`` is a :class:`_Service`: each attention call of the light op first serves
  one request (header, tensors, the non-causal partial attention with the kernel the header
  names, the answer back), and after the op the rest are served until DONE.

Why on the main thread, inside the light op, and not in a thread of its own: NCCL completes a
GPU's communication in launch order (``CUDA_DEVICE_MAX_CONNECTIONS=1``, docs/nccl.md rule 3). A
service thread keeps a receive posted from the start of the step, and every transfer its rank
launches later waits behind it. Served inside the light op, the pair's exchange has one place in
each rank's launch order, the slot's end, and the step's message order puts every other
transfer before or after it on both ranks (``schedule/message_order.py``, ``exchanges``), which
``schedule/nccl_check.py`` proves for every generator. Serving one request per attention call
keeps the two ops layer by layer side by side, as the paper overlaps them.

Each pair's group is used by the main thread of each side only, as NCCL wants. Every receive has
the runtime's deadline (``p2p.PipeComm``): a dead peer gives a :class:`PeerError` naming the
rank, the op and the peer; a failed request names both ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import SliceContext, SlicedCoreAttention
from ..attention.backends import KERNEL_NAMES, kernel_named
from ..attention.math_kernel import compute_dtype
from ..attention.remote import serve_backward, serve_forward
from ..schedule.ir import Op, OpKind, Schedule
from ..schedule.redistribute import Delegation, check_cap, delegation_plan, plan_links
from .p2p import PeerError, PipeComm

DONE, FORWARD, BACKWARD = 0, 1, 2
HEADER = 11  # kind, kernel, dtype, b, h, sq, g, nk, d, dv, scale
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
Plan = dict[tuple[int, Op], Delegation]
Spec = tuple[tuple[int, ...], torch.dtype]
ATTENTION_KINDS = (OpKind.F, OpKind.B, OpKind.BW)  # ops that run attention layers


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

    def done(self) -> None:
        """Tell the partner that this op has no more requests (its light op may end)."""
        self.channel.wait(self.channel.send([_header(DONE)], "attention DONE"), "attention DONE to")


# ---- the partner side -----------------------------------------------------------------------


class _Service:
    """Serves one source rank's heavy op on this rank's main thread, inside the light op of the
    same slot: one request per attention call of the light op (``serve_one``), the rest after
    it (``serve_rest``), until the source's DONE."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.served = 0
        self.requests = 0
        self.open = False  # between the light op's start and the source's DONE

    def begin(self) -> None:
        self.open = True

    def serve_one(self) -> None:
        """Serve the source's next request, or take its DONE; nothing once DONE came."""
        if not self.open:
            return
        try:
            with torch.no_grad():
                self.open = self._serve_one()
        except PeerError:
            raise
        except Exception as error:
            raise PeerError(
                f"rank {self.channel.comm.rank}: the attention service for rank {self.channel.peer} "
                f"failed after {self.requests} requests: {type(error).__name__}: {error}"
            ) from error

    def serve_rest(self) -> None:
        while self.open:
            self.serve_one()

    def _serve_one(self) -> bool:
        what = "attention request"
        (header,) = self.channel.recv([((HEADER,), torch.float64)], what)
        kind = int(header[0])
        if kind == DONE:
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

    def begin(self, plan: Plan, contexts: Sequence[SliceContext], placement: Any) -> StepRedistribution:
        return StepRedistribution(self, plan, contexts, placement)

    def channel(self, source: int, partner: int, peer: int, device: torch.device) -> _Channel:
        return _Channel(self.comm, self._groups[(source, partner)], peer, device)


class StepRedistribution:
    """One step on one rank: the delegations of this rank's heavy ops, the services of its light
    ops, and the counts."""

    def __init__(
        self,
        owner: Redistribution,
        plan: Plan,
        contexts: Sequence[SliceContext],
        placement: Any,
    ) -> None:
        self.comm = owner.comm
        self.contexts = list(contexts)
        self.placement = placement
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
        self.serves = {d.light: self.services[r] for (r, _), d in plan.items() if d.partner == rank}
        stages = placement.stages_of(rank)
        for index, context in enumerate(self.contexts):
            context.delegating = any(op.stage == stages[index] for op in self.delegations)

    def involves(self, op: Op) -> bool:
        """Whether :meth:`running` has anything to do around ``op``."""
        return op.kind in ATTENTION_KINDS or op in self.serves

    @contextmanager
    def running(self, op: Op) -> Iterator[None]:
        """Around any op of the step: for a heavy F/B/BW its delegation (then DONE), for a light
        op the service of its partner (one request per attention call, the rest after it); an
        F/B/BW's attention counted."""
        delegation = self.delegations.get(op)
        partner = None
        if delegation is not None:
            channel = self.partners[delegation.partner]
            partner = PartnerAttention(channel, delegation.oldest_slices, str(op))
        service = self.serves.get(op)
        if service is not None:
            service.begin()
        if op.kind not in ATTENTION_KINDS:  # W, S, T: no attention to delegate or count
            yield
        else:
            context = self.contexts[self.placement.chunk_index(op.stage)]
            context.current_delegation, context.current_service = partner, service
            local, remote = context.pairs_local, context.pairs_remote
            try:
                yield
            finally:
                context.current_delegation = context.current_service = None
            self.counts.own[op] = self.counts.own.get(op, 0) + context.pairs_local - local
            if context.pairs_remote > remote:
                self.counts.delegated[op] = self.counts.delegated.get(op, 0) + context.pairs_remote - remote
        if partner is not None:
            partner.done()
        if service is not None:
            service.serve_rest()

    def finish(self) -> AttentionCounts:
        """The counts of the step; every light op has served its partner until DONE."""
        for source, service in self.services.items():
            self.counts.served[source] = service.served
        return self.counts

    def abandon(self) -> None:
        """After a failed step: no delegation or service stays set."""
        for context in self.contexts:
            context.current_delegation = None
            context.current_service = None
            context.delegating = False


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
