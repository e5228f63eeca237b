"""The schedule IR: for each pipeline rank, an ordered list of ops.

A compute op names what it computes: its kind (F, B, W or BW), the virtual stage (model chunk)
it runs, the microbatch and the sequence slice. Lowering passes (see ``lowering.py``) add
communication ops (SEND/RECV) and activation copies (OFFLOAD/RELOAD) through the same type, so
the simulator and the runtime read one format. Vocabulary parallelism (``vocab.py``) adds the
output-layer passes S and T, which run on every rank, and the collectives over the pipeline
group that feed them (``docs/vocab_parallel.md`` says what each computes). A schedule
round-trips through a small text form and JSON, so a user can write one by hand and load it.

This module is pure Python on purpose: the whole schedule core runs without torch.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class OpKind(str, enum.Enum):
    """What an op does. Compute kinds first, then the kinds that lowering passes add."""

    F = "F"  # forward
    B = "B"  # backward w.r.t. the input only (weight gradients deferred to W)
    W = "W"  # the deferred weight-gradient part of a B
    BW = "BW"  # classic fused backward (input and weight gradients)
    SEND_F = "SEND_F"  # send this stage's output activation to the next stage's rank
    RECV_F = "RECV_F"  # receive this stage's input activation from the previous stage's rank
    SEND_B = "SEND_B"  # send the gradient of this stage's input to the previous stage's rank
    RECV_B = "RECV_B"  # receive the gradient of this stage's output from the next stage's rank
    OFFLOAD = "OFFLOAD"  # copy what the unit's F saved for its backward to host memory
    RELOAD = "RELOAD"  # copy it back to the device ahead of the unit's B (or BW)
    # Vocabulary parallelism: every rank runs these for every unit (stage = the last stage for
    # the output layer, 0 for the input embedding); see docs/vocab_parallel.md.
    S = "S"  # output layer, first pass: this rank's logits shard and its softmax statistics
    T = "T"  # output layer, second pass: softmax gradient, weight gradient (vocab-1: input grad)
    BCAST_X = "BCAST_X"  # the last stage's output (and labels) from the loss rank to every rank
    REDUCE_S = "REDUCE_S"  # the barrier after S: global max/sum (vocab-2: and the input gradient)
    REDUCE_T = "REDUCE_T"  # vocab-1, the barrier after T: input-gradient partials to the loss rank
    BCAST_IDS = "BCAST_IDS"  # the unit's token ids from the first stage's rank to every rank
    REDUCE_EMB = "REDUCE_EMB"  # embedding lookups of every rank summed to the first stage's rank
    BCAST_DEMB = "BCAST_DEMB"  # the embedding output's gradient from the first stage's rank to all


COMPUTE_KINDS = frozenset({OpKind.F, OpKind.B, OpKind.W, OpKind.BW})
COMM_KINDS = frozenset({OpKind.SEND_F, OpKind.RECV_F, OpKind.SEND_B, OpKind.RECV_B})
BACKWARD_KINDS = frozenset({OpKind.B, OpKind.BW})
COPY_KINDS = frozenset({OpKind.OFFLOAD, OpKind.RELOAD})
VOCAB_COMPUTE_KINDS = frozenset({OpKind.S, OpKind.T})
COLLECTIVE_KINDS = frozenset(
    {
        OpKind.BCAST_X,
        OpKind.REDUCE_S,
        OpKind.REDUCE_T,
        OpKind.BCAST_IDS,
        OpKind.REDUCE_EMB,
        OpKind.BCAST_DEMB,
    }
)
VOCAB_KINDS = VOCAB_COMPUTE_KINDS | COLLECTIVE_KINDS


@dataclass(frozen=True)
class Op:
    """One step of one rank. ``peer`` is the other rank of a communication op."""

    kind: OpKind
    stage: int
    microbatch: int
    slice: int = 0
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_copy(self) -> bool:
        """An activation copy between device and host (OFFLOAD or RELOAD)."""
        return self.kind in COPY_KINDS

    @property
    def is_vocab(self) -> bool:
        """An op of vocabulary parallelism (S, T or one of its collectives): on every rank."""
        return self.kind in VOCAB_KINDS

    @property
    def is_collective(self) -> bool:
        """A collective over all pipeline ranks (issued asynchronously, in the same order)."""
        return self.kind in COLLECTIVE_KINDS

    @property
    def unit(self) -> tuple[int, int, int]:
        """(stage, microbatch, slice): what the op works on, whatever its kind."""
        return (self.stage, self.microbatch, self.slice)

    def __str__(self) -> str:
        return format_op(self)


# Longest names first, so that B does not swallow the start of BW or BCAST_X.
_KIND_NAMES = "|".join(sorted((kind.value for kind in OpKind), key=len, reverse=True))
_OP_PATTERN = re.compile(
    rf"^(?P<kind>{_KIND_NAMES})(?P<stage>\d+):(?P<mb>\d+)"
    r"(?:\.(?P<slice>\d+))?(?:(?P<dir>[<>])(?P<peer>\d+))?$"
)


def format_op(op: Op) -> str:
    """``F2:5.1`` is the forward of stage 2, microbatch 5, slice 1; ``SEND_F2:5.1>3`` goes to rank 3."""
    text = f"{op.kind.value}{op.stage}:{op.microbatch}"
    if op.slice:
        text += f".{op.slice}"
    if op.peer is not None:
        text += (">" if op.kind in (OpKind.SEND_F, OpKind.SEND_B) else "<") + str(op.peer)
    return text


def parse_op(token: str) -> Op:
    """Inverse of :func:`format_op`."""
    match = _OP_PATTERN.match(token.strip())
    if not match:
        raise ValueError(
            f"cannot read op {token!r}: expected KIND STAGE:MICROBATCH[.SLICE], e.g. F0:3 or B1:2.1"
        )
    peer = match.group("peer")
    return Op(
        kind=OpKind(match.group("kind")),
        stage=int(match.group("stage")),
        microbatch=int(match.group("mb")),
        slice=int(match.group("slice") or 0),
        peer=None if peer is None else int(peer),
    )


def matching_op(op: Op) -> Op:
    """The op on the peer rank that pairs with a comm op (SEND_F s <-> RECV_F s+1, ...)."""
    if op.kind == OpKind.SEND_F:
        return Op(OpKind.RECV_F, op.stage + 1, op.microbatch, op.slice)
    if op.kind == OpKind.RECV_F:
        return Op(OpKind.SEND_F, op.stage - 1, op.microbatch, op.slice)
    if op.kind == OpKind.SEND_B:
        return Op(OpKind.RECV_B, op.stage - 1, op.microbatch, op.slice)
    if op.kind == OpKind.RECV_B:
        return Op(OpKind.SEND_B, op.stage + 1, op.microbatch, op.slice)
    raise ValueError(f"{op} is not a communication op")


PLACEMENT_STYLES = ("interleaved", "vshape")


@dataclass(frozen=True)
class Placement:
    """Which rank runs each virtual stage.

    ``interleaved`` is Megatron's round-robin (stage s on rank s mod p). ``vshape`` folds the
    stages back and forth: stage s on rank s for s < p and on rank 2p-1-s for p <= s < 2p (and
    so on, zig-zag, for more chunks), so rank 0 holds the first and the last stage.
    """

    pp: int
    num_stages: int
    style: str = "interleaved"

    def __post_init__(self) -> None:
        if self.style not in PLACEMENT_STYLES:
            raise ValueError(f"unknown placement {self.style!r}; choose from {PLACEMENT_STYLES}")
        if self.pp < 1 or self.num_stages < self.pp or self.num_stages % self.pp:
            raise ValueError(
                f"{self.num_stages} virtual stages cannot be placed on {self.pp} ranks: "
                "the number of stages must be a positive multiple of the pipeline size"
            )

    @property
    def chunks_per_rank(self) -> int:
        return self.num_stages // self.pp

    def rank_of(self, stage: int) -> int:
        chunk, position = divmod(stage, self.pp)
        if self.style == "vshape" and chunk % 2 == 1:
            return self.pp - 1 - position
        return position

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def chunk_index(self, stage: int) -> int:
        """Position of ``stage`` among the stages of its rank (the model chunk index)."""
        return stage // self.pp


@dataclass
class Schedule:
    """Per-rank op lists plus the sizes they were generated for.

    ``meta`` keeps the generator's parameters (warm-up counts, memory limit, ...) for pictures and
    reports; nothing downstream depends on it.
    """

    name: str
    pp: int
    microbatches: int
    num_stages: int
    slices: int
    placement: Placement
    ranks: list[list[Op]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def vpp(self) -> int:
        return self.num_stages // self.pp

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into B and W ops (zero-bubble style)."""
        return any(op.kind == OpKind.W for ops in self.ranks for op in ops)

    @property
    def is_lowered(self) -> bool:
        return any(op.is_comm for ops in self.ranks for op in ops)

    @property
    def offloads(self) -> bool:
        """True when the schedule copies activations to host memory (has OFFLOAD ops)."""
        return any(op.kind == OpKind.OFFLOAD for ops in self.ranks for op in ops)

    @property
    def vocab_parallel(self) -> str:
        """``none``, or the variant of the vocabulary passes: ``vocab-1`` has a REDUCE_T (a second
        barrier, after T), ``vocab-2`` does not."""
        kinds = {op.kind for ops in self.ranks for op in ops if op.is_vocab}
        if not kinds:
            return "none"
        return "vocab-1" if OpKind.REDUCE_T in kinds else "vocab-2"

    @property
    def loss_rank(self) -> int:
        return self.placement.rank_of(self.num_stages - 1)

    def compute_ops(self, rank: int) -> list[Op]:
        return [op for op in self.ranks[rank] if op.is_compute]

    def all_ops(self) -> Iterator[tuple[int, int, Op]]:
        """(rank, position, op) for every op."""
        for rank, ops in enumerate(self.ranks):
            for position, op in enumerate(ops):
                yield rank, position, op

    def with_ranks(self, ranks: list[list[Op]], **meta: Any) -> Schedule:
        return Schedule(
            name=self.name,
            pp=self.pp,
            microbatches=self.microbatches,
            num_stages=self.num_stages,
            slices=self.slices,
            placement=self.placement,
            ranks=ranks,
            meta={**self.meta, **meta},
        )

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "num_stages": self.num_stages,
            "slices": self.slices,
            "placement": self.placement.style,
            "meta": self.meta,
            "ranks": [[format_op(op) for op in ops] for ops in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        pp = int(data["pp"])
        num_stages = int(data.get("num_stages", pp))
        ranks = [[parse_op(tok) for tok in ops] for ops in data["ranks"]]
        if len(ranks) != pp:
            raise ValueError(f"schedule lists {len(ranks)} ranks but pp is {pp}")
        return cls(
            name=str(data.get("name", "custom")),
            pp=pp,
            microbatches=int(data["microbatches"]),
            num_stages=num_stages,
            slices=int(data.get("slices", 1)),
            placement=Placement(pp, num_stages, str(data.get("placement", "interleaved"))),
            ranks=ranks,
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def comm_digest(self) -> int:
        """A 63-bit digest of every rank's messages and collectives in their order: what ranks
        must agree on to talk (their compute and activation copies may differ, e.g. offload's
        measured k). The runtime's warm-up compares it between peers (``runtime/creation.py``)."""
        parts = [
            f"{rank}:" + " ".join(format_op(op) for op in ops if op.is_comm or op.is_collective)
            for rank, ops in enumerate(self.ranks)
        ]
        header = f"{self.pp} {self.num_stages} {self.microbatches} {self.slices} {self.placement.style}"
        digest = hashlib.sha256("\n".join([header, *parts]).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))

    def to_text(self) -> str:
        """A readable form: a header of ``key: value`` lines, then ``rank R: op op op ...``."""
        lines = [
            "# megatron_pp_ext schedule",
            f"name: {self.name}",
            f"pp: {self.pp}",
            f"microbatches: {self.microbatches}",
            f"num_stages: {self.num_stages}",
            f"slices: {self.slices}",
            f"placement: {self.placement.style}",
        ]
        if self.meta:
            lines.append(f"meta: {json.dumps(self.meta, sort_keys=True)}")
        for rank, ops in enumerate(self.ranks):
            lines.append(f"rank {rank}: " + " ".join(format_op(op) for op in ops))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        header: dict[str, Any] = {}
        ranks: dict[int, list[str]] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"line {number}: expected 'key: value' or 'rank R: ops', got {raw!r}")
            key, value = key.strip(), value.strip()
            if key.startswith("rank "):
                ranks[int(key.split()[1])] = value.split()
            elif key == "meta":
                header["meta"] = json.loads(value)
            else:
                header[key] = value
        missing = [key for key in ("pp", "microbatches") if key not in header]
        if missing:
            raise ValueError(
                f"no {' and no '.join(repr(k + ':') for k in missing)} line: a schedule file starts with "
                "'pp: P' and 'microbatches: M', then one 'rank R: ops' line per rank (README, "
                "'Schedule text format')"
            )
        header["ranks"] = [ranks.get(r, []) for r in range(int(header["pp"]))]
        return cls.from_dict(header)


def save(schedule: Schedule, path: str) -> None:
    """Write JSON for ``*.json`` paths and the text form otherwise."""
    text = schedule.to_json() if path.endswith(".json") else schedule.to_text()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def load(path: str) -> Schedule:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    return Schedule.from_json(text) if text.lstrip().startswith("{") else Schedule.from_text(text)


def units(num_microbatches: int, num_slices: int) -> list[tuple[int, int]]:
    """Forward order of the schedulable units (microbatch, slice): microbatches FIFO, slices in order."""
    return [(mb, j) for mb in range(num_microbatches) for j in range(num_slices)]


def backward_units(num_microbatches: int, num_slices: int) -> list[tuple[int, int]]:
    """Backward order: microbatches FIFO, each microbatch's slices last-first."""
    return [(mb, j) for mb in range(num_microbatches) for j in reversed(range(num_slices))]


def count_kinds(ops: Iterable[Op]) -> dict[OpKind, int]:
    counts: dict[OpKind, int] = {}
    for op in ops:
        counts[op.kind] = counts.get(op.kind, 0) + 1
    return counts
