"""The schedule contract with Megatron's DDP (``runtime/grad_sync.py``), on hand-made op lists:
when each chunk leaves ``no_sync``, starts its gradient reduction and its parameter gather."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_pp_ext.runtime.grad_sync import GradSync  # noqa: E402
from megatron_pp_ext.schedule.ir import Op, OpKind  # noqa: E402

F, B, W, BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW


class FakeChunk(torch.nn.Module):
    """A DDP look-alike that records what the runtime asks of it."""

    def __init__(self, name: str, events: list[str], overlap: bool = True) -> None:
        super().__init__()
        self.name = name
        self.events = events
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.ddp_config = SimpleNamespace(overlap_grad_reduce=overlap)

    @contextmanager
    def no_sync(self):
        self.events.append(f"enter {self.name}")
        yield
        self.events.append(f"exit {self.name}")

    def start_grad_sync(self, *unused) -> None:
        self.events.append(f"grad {self.name}")

    def start_param_sync(self, *unused) -> None:
        self.events.append(f"param {self.name}")


def _drive(sync: GradSync, ops: list[Op], events: list[str]) -> None:
    sync.begin()
    for position, op in enumerate(ops):
        sync.before(position)
        events.append(f"{op.kind.value}{op.stage}.{op.microbatch}")
        sync.after(position)
    sync.finish()


# rank 0 of a V: stage 0 (chunk 0) and stage 3 (chunk 1); B/W split, chunk 1's last W comes first
OPS = [
    Op(F, 0, 0),
    Op(F, 3, 0),
    Op(B, 3, 0),
    Op(F, 0, 1),
    Op(F, 3, 1),
    Op(B, 3, 1),
    Op(W, 3, 0),
    Op(B, 0, 0),
    Op(W, 3, 1),
    Op(B, 0, 1),
    Op(W, 0, 0),
    Op(W, 0, 1),
]
CHUNK_OF = {0: 0, 3: 1}.__getitem__


def test_each_chunk_syncs_after_its_last_weight_gradient_op() -> None:
    events: list[str] = []
    chunks = [FakeChunk("c0", events), FakeChunk("c1", events)]
    config = SimpleNamespace(
        no_sync_func=[c.no_sync for c in chunks],
        grad_sync_func=[c.start_grad_sync for c in chunks],
        param_sync_func=[c.start_param_sync for c in chunks],
    )
    _drive(GradSync(config, chunks, OPS, CHUNK_OF), OPS, events)
    assert events[:2] == ["enter c0", "enter c1"]
    # parameters gathered just before each chunk's first forward
    assert events.index("param c0") == events.index("F0.0") - 1
    assert events.index("param c1") == events.index("F3.0") - 1
    # chunk 1 is done after W3.1 (not after its last B), chunk 0 after W0.1
    assert events[events.index("W3.1") + 1 : events.index("W3.1") + 3] == ["exit c1", "grad c1"]
    assert events[-3:] == ["W0.1", "exit c0", "grad c0"]
    assert events.count("grad c0") == events.count("grad c1") == 1


def test_ddp_chunks_without_config_functions_use_their_own() -> None:
    """Megatron-LM sets no grad_sync_func without --align-grad-reduce; split W never fires DDP's
    hooks, so the runtime still starts each overlapped chunk's reduction itself."""
    events: list[str] = []
    chunks = [FakeChunk("c0", events), FakeChunk("c1", events)]
    config = SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    _drive(GradSync(config, chunks, OPS, CHUNK_OF), OPS, events)
    assert events.count("grad c0") == events.count("grad c1") == 1
    assert "param c0" not in events
    assert events.index("grad c1") < events.index("B0.1")


def test_one_no_sync_covers_all_chunks_and_one_grad_sync_serves_each_chunk() -> None:
    """A single ``no_sync_func`` is one context over every chunk; a single ``grad_sync_func`` is
    called for each chunk with its own parameters after that chunk's last weight-gradient op, as
    megatron-core's interleaved schedule copies it per chunk (``[func for _ in model]``)."""
    events: list[str] = []
    chunks = [FakeChunk("c0", events, overlap=False), FakeChunk("c1", events, overlap=False)]
    owners = {id(p): chunk.name for chunk in chunks for p in chunk.parameters()}

    def grad_sync(params) -> None:
        events.append("grad " + "+".join(owners[id(p)] for p in params))

    config = SimpleNamespace(no_sync_func=chunks[0].no_sync, grad_sync_func=grad_sync, param_sync_func=None)
    _drive(GradSync(config, chunks, OPS, CHUNK_OF), OPS, events)
    assert events[0] == "enter c0" and events.count("enter c0") == 1
    assert events[events.index("W3.1") + 1] == "grad c1"  # chunk 1 done at its last W
    assert events[-3:] == ["W0.1", "exit c0", "grad c0"]
    assert [e for e in events if e.startswith("grad")] == ["grad c1", "grad c0"]


def test_forward_only_starts_no_reduction() -> None:
    events: list[str] = []
    chunks = [FakeChunk("c0", events), FakeChunk("c1", events)]
    forwards = [op for op in OPS if op.kind == F]
    config = SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    _drive(GradSync(config, chunks, forwards, CHUNK_OF, forward_only=True), forwards, events)
    assert not [e for e in events if e.startswith("grad")]
    assert events.count("enter c0") == events.count("exit c0") == 1


def test_a_list_of_the_wrong_length_is_refused() -> None:
    chunks = [FakeChunk("c0", []), FakeChunk("c1", [])]
    config = SimpleNamespace(no_sync_func=[chunks[0].no_sync], grad_sync_func=None, param_sync_func=None)
    with pytest.raises(ValueError, match="1 sync functions in the model config for 2 model chunks"):
        GradSync(config, chunks, OPS, CHUNK_OF)
