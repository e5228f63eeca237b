"""The per-step features as collaborators (``runtime/step_feature.py``, ``runtime/features.py``),
each alone, in one process, on fakes of what it drives; and the executor's loop that calls them
(``_StepRun.execute``), on fake features: the order of the calls and which failures name the op."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from test_grad_sync import FakeChunk  # noqa: E402  (the DDP look-alike that records calls)

from megatron_pp_ext.runtime.executor import _Messages, _Stages, _StepRun  # noqa: E402
from megatron_pp_ext.runtime.features import (  # noqa: E402
    GateFeature,
    GradSyncFeature,
    OffloadFeature,
    RedistributionFeature,
    Restart,
    SlicingFeature,
    VocabFeature,
)
from megatron_pp_ext.runtime.grad_sync import GradSync  # noqa: E402
from megatron_pp_ext.runtime.offload import OffloadEngine  # noqa: E402
from megatron_pp_ext.runtime.p2p import PeerError  # noqa: E402
from megatron_pp_ext.runtime.step_feature import OpFailure, PipelineError, StepFeature  # noqa: E402
from megatron_pp_ext.schedule.ir import Op, OpKind  # noqa: E402

F, B, W, BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW


class Recorder:
    """Records the calls made on it, by name (any method)."""

    def __init__(self, events: list[str], name: str) -> None:
        self.events = events
        self.name = name

    def __getattr__(self, method: str) -> Any:
        return lambda *args: self.events.append(f"{self.name}.{method}")


# ---- OpFailure ----------------------------------------------------------------------------------


def test_op_failure_names_the_op_and_passes_what_already_names_itself() -> None:
    op = Op(F, 1, 2)
    with pytest.raises(PipelineError, match=r"rank 3: op F1:2 \(position 7\) failed: boom") as caught:
        with OpFailure(3, 7, op):
            raise ValueError("boom")
    assert isinstance(caught.value.__cause__, ValueError)
    for error in (PipelineError("named"), PeerError("peer"), KeyboardInterrupt()):
        with pytest.raises(type(error)) as caught:
            with OpFailure(3, 7, op):
                raise error
        assert caught.value is error


def test_op_failure_names_an_exhausted_iterator_too() -> None:
    """StopIteration out of a forward (a data iterator ran dry) is reported as the op's like any
    error (a generator-based context manager would hand the StopIteration back instead)."""
    with pytest.raises(PipelineError, match="failed"):
        with OpFailure(0, 0, Op(F, 0, 0)):
            next(iter([]))


# ---- the validation gate ------------------------------------------------------------------------


def test_gate_settles_once_ahead_of_its_position() -> None:
    calls: list[int] = []
    gate = GateFeature(lambda: calls.append(len(calls)) or True, position=2)
    for position in range(4):
        gate.before(position, Op(F, 0, position))
        assert len(calls) == (1 if position >= 2 else 0)
    gate.finish()  # passed already: no second settle
    assert calls == [0]


def test_gate_of_a_rank_with_forwards_only_settles_at_the_end() -> None:
    calls: list[bool] = []
    gate = GateFeature(lambda: calls.append(True) or True, position=2)
    gate.before(0, Op(F, 0, 0))
    gate.before(1, Op(F, 0, 1))
    gate.finish()
    assert calls == [True]


def test_gate_restarts_from_the_random_state_the_attempt_began_with() -> None:
    torch.manual_seed(5)
    gate = GateFeature(lambda: False, position=1)
    first = torch.rand(3)  # the forwards before the gate draw (dropout)
    with pytest.raises(Restart) as caught:
        gate.before(1, Op(B, 0, 0))
    gate.discard(caught.value)
    assert torch.equal(torch.rand(3), first)


def test_gate_keeps_the_random_state_on_any_other_failure() -> None:
    gate = GateFeature(lambda: True, position=1)
    torch.rand(1)  # the state moves on from the one the gate took
    state = torch.get_rng_state()
    gate.discard(PipelineError("an op failed"))
    assert torch.equal(torch.get_rng_state(), state)


# ---- gradient sync ------------------------------------------------------------------------------


def _sync(events: list[str], ops: list[Op], late: tuple[int, ...] = ()) -> tuple[GradSync, list[FakeChunk]]:
    chunks = [FakeChunk("c0", events), FakeChunk("c1", events)]
    config = SimpleNamespace(
        no_sync_func=[c.no_sync for c in chunks],
        grad_sync_func=[c.start_grad_sync for c in chunks],
        param_sync_func=[c.start_param_sync for c in chunks],
    )
    return GradSync(config, chunks, ops, {0: 0, 3: 1}.__getitem__, late_chunks=late), chunks


OPS = [Op(F, 0, 0), Op(F, 3, 0), Op(BW, 3, 0), Op(BW, 0, 0)]


def _drive(feature: StepFeature, ops: list[Op], events: list[str]) -> None:
    feature.begin()
    for position, op in enumerate(ops):
        feature.before(position, op)
        events.append(f"{op.kind.value}{op.stage}")
        feature.after(position, op)
    feature.finish()


def test_grad_sync_feature_drives_grad_sync_at_each_position() -> None:
    events: list[str] = []
    sync, _ = _sync(events, OPS)
    _drive(GradSyncFeature(sync, rank=0), OPS, events)
    assert events == [
        "enter c0",
        "enter c1",
        "param c0",
        "F0",
        "param c1",
        "F3",
        "BW3",
        "exit c1",
        "grad c1",
        "BW0",
        "exit c0",
        "grad c0",
    ]


def test_grad_sync_feature_syncs_late_chunks_at_the_end() -> None:
    """The vocabulary shards' chunk (late) syncs in finish, after the features before it."""
    events: list[str] = []
    sync, _ = _sync(events, OPS, late=(0,))
    _drive(GradSyncFeature(sync, rank=0), OPS, events)
    assert events[-3:] == ["BW0", "exit c0", "grad c0"]
    assert events.index("grad c1") < events.index("BW0")


def test_grad_sync_feature_discard_leaves_every_no_sync() -> None:
    events: list[str] = []
    sync, _ = _sync(events, OPS)
    feature = GradSyncFeature(sync, rank=0)
    feature.begin()
    feature.discard(PipelineError("an op failed"))
    assert events == ["enter c0", "enter c1", "exit c0", "exit c1"]


def test_grad_sync_feature_names_the_op_whose_parameter_gather_failed() -> None:
    def failing(*unused: Any) -> None:
        raise RuntimeError("all-gather refused")

    chunks = [FakeChunk("c0", [])]
    config = SimpleNamespace(param_sync_func=failing)
    feature = GradSyncFeature(GradSync(config, chunks, OPS[:1], lambda stage: 0), rank=2)
    with pytest.raises(PipelineError, match=r"rank 2: op F0:0 \(position 0\) failed: all-gather refused"):
        feature.before(0, OPS[0])


# ---- vocabulary, offload, slices ------------------------------------------------------------------


def test_vocab_feature_finishes_or_discards_the_vocab_step() -> None:
    events: list[str] = []
    feature = VocabFeature(Recorder(events, "vocab"))  # type: ignore[arg-type]
    _drive(feature, OPS, events)
    feature.discard(PipelineError("x"))
    assert [e for e in events if e.startswith("vocab")] == ["vocab.finish", "vocab.discard"]


def test_offload_feature_checks_every_unit_came_back() -> None:
    engine = OffloadEngine("cpu")
    ops = [Op(F, 0, 0), Op(OpKind.OFFLOAD, 0, 0), Op(OpKind.RELOAD, 0, 0), Op(BW, 0, 0)]
    assert engine.begin(engine.meter, ops, [])
    x = torch.randn(512, 8, requires_grad=True)
    with engine.saving((0, 0, 0), None):
        y = ((x * 2) ** 2).sum()  # saves x * 2 (16 KiB, held by nothing else: it moves)
    feature = OffloadFeature(engine)
    engine.offload((0, 0, 0))
    with pytest.raises(RuntimeError, match=r"units \[\(0, 0, 0\)\] were offloaded and never reloaded"):
        feature.finish()
    feature.discard(RuntimeError("stranded"))
    assert not engine._units and not engine._offloaded
    del y


def test_offload_feature_finish_reports_the_copies() -> None:
    engine = OffloadEngine("cpu")
    ops = [Op(F, 0, 0), Op(OpKind.OFFLOAD, 0, 0), Op(OpKind.RELOAD, 0, 0), Op(BW, 0, 0)]
    engine.begin(engine.meter, ops, [])
    x = torch.randn(512, 8, requires_grad=True)
    with engine.saving((0, 0, 0), None):
        y = ((x * 2) ** 2).sum()
    engine.offload((0, 0, 0))
    engine.reload((0, 0, 0))
    y.backward()
    OffloadFeature(engine).finish()
    assert engine.stats.offloaded_bytes == engine.stats.reloaded_bytes > 0
    assert torch.allclose(x.grad, 8 * x.detach())


def test_slicing_feature_releases_the_caches_only_after_a_failure() -> None:
    events: list[str] = []
    feature = SlicingFeature(Recorder(events, "slicing"))  # type: ignore[arg-type]
    _drive(feature, OPS, events)
    assert not [e for e in events if e.startswith("slicing")]
    feature.discard(PipelineError("x"))
    assert events[-1] == "slicing.release"


# ---- attention redistribution ---------------------------------------------------------------------


class FakeRedistribution:
    """StepRedistribution's interface: ``running(op)`` around the ops it involves (F and B here)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.counts = "counts"

    def involves(self, op: Op) -> bool:
        return op.kind in (F, B)

    @contextmanager
    def running(self, op: Op):
        self.events.append(f"set {op}")
        try:
            yield
        finally:
            self.events.append(f"clear {op}")
        self.events.append(f"done {op}")  # DONE to the partner: only after an op that ran

    def finish(self) -> str:
        self.events.append("finish")
        return self.counts

    def abandon(self) -> None:
        self.events.append("abandon")


def test_redistribution_feature_runs_around_the_ops_it_involves() -> None:
    events: list[str] = []
    ops = [Op(F, 0, 0), Op(W, 0, 0), Op(B, 0, 0)]
    _drive(RedistributionFeature(FakeRedistribution(events), rank=0), ops, events)  # type: ignore[arg-type]
    assert events == [
        "set F0:0",
        "F0",
        "clear F0:0",
        "done F0:0",
        "W0",
        "set B0:0",
        "B0",
        "clear B0:0",
        "done B0:0",
        "finish",
    ]


def test_redistribution_feature_leaves_a_failed_op_as_a_with_would() -> None:
    """The op raised: its delegation is cleared (the ``finally``), no DONE is sent, and the step
    is abandoned."""
    events: list[str] = []
    feature = RedistributionFeature(FakeRedistribution(events), rank=0)  # type: ignore[arg-type]
    feature.begin()
    feature.before(0, Op(F, 0, 0))
    error = PipelineError("rank 0: op F0:0 (position 0) failed: boom")
    feature.discard(error)
    assert events == ["set F0:0", "clear F0:0", "abandon"]
    feature.discard(error)  # nothing open any more: only abandoned again
    assert events[-2:] == ["abandon", "abandon"]


# ---- the executor's own: messages and stages ------------------------------------------------------


def _run(events: list[str], **parts: Any) -> Any:
    comm = Recorder(events, "comm")
    return SimpleNamespace(rt=SimpleNamespace(rank=1, comm=comm), **parts)


def test_messages_flush_at_the_end_and_are_forgotten_after_a_failure() -> None:
    events: list[str] = []
    run = _run(events, settle_received=lambda: events.append("settle_received"))
    messages = _Messages(run)
    messages.finish()
    messages.discard(PipelineError("x"))
    messages.discard(Restart())  # the gate restarts the step: take in what was posted instead
    assert events == ["comm.flush", "comm.abandon", "settle_received"]


def test_stages_must_end_empty_and_are_dropped_after_a_failure() -> None:
    events: list[str] = []
    runners = {0: Recorder(events, "runner0"), 3: Recorder(events, "runner3")}
    stages = _Stages(_run(events, runners=runners, leftovers=lambda: []))
    stages.finish()
    stages.discard(PipelineError("x"))
    assert events == ["runner0.discard", "runner3.discard"]
    left = _Stages(_run(events, runners=runners, leftovers=lambda: [f"unused message {i}" for i in range(7)]))
    with pytest.raises(PipelineError, match=r"rank 1: step ended with unused message 0; .*message 4$"):
        left.finish()


def test_the_features_of_a_step_in_the_order_its_end_needs() -> None:
    run = object.__new__(_StepRun)
    run.rt = SimpleNamespace(rank=0)
    run.vocab = run.slicing = None
    sync, _ = _sync([], OPS)
    names = [type(feature).__name__ for feature in run.features(sync, None, None, None)]
    assert names == ["_Messages", "GradSyncFeature", "_Stages"]
    run.vocab, run.slicing = Recorder([], "vocab"), Recorder([], "slicing")
    engine, redistribution = OffloadEngine("cpu"), FakeRedistribution([])
    features = run.features(sync, engine, redistribution, (lambda: True, 1))  # type: ignore[arg-type]
    assert [type(feature).__name__ for feature in features] == [
        "GateFeature",
        "_Messages",
        "VocabFeature",
        "GradSyncFeature",
        "_Stages",
        "OffloadFeature",
        "RedistributionFeature",
        "SlicingFeature",
    ]


# ---- the loop that calls them ---------------------------------------------------------------------


def _step_run(
    events: list[str], ops: list[Op], fail_at: int | None = None, pair_starts: set[int] | None = None
) -> _StepRun:
    run = object.__new__(_StepRun)
    run.rt = SimpleNamespace(rank=0, comm=SimpleNamespace(reap=lambda: events.append("reap")))
    run.schedule = SimpleNamespace(ranks=[ops])
    run.op_count = {}
    run.step = SimpleNamespace(paired=pair_starts is not None)
    run._pair_starts = lambda: pair_starts  # type: ignore[method-assign]
    run._pair = lambda first, second: events.append(f"pair {first} {second}")  # type: ignore[method-assign]

    def dispatch(op: Op) -> None:
        if fail_at is not None and op == ops[fail_at]:
            raise ValueError("op broke")
        events.append(f"run {op}")

    run._dispatch = dispatch  # type: ignore[method-assign]
    return run


class Traced(StepFeature):
    def __init__(self, name: str, events: list[str], fail_before: int | None = None) -> None:
        self.name = name
        self.events = events
        self.fail_before = fail_before

    def begin(self) -> None:
        self.events.append(f"{self.name}.begin")

    def before(self, position: int, op: Op) -> None:
        if position == self.fail_before:
            raise ValueError("not the op's")
        self.events.append(f"{self.name}.before {position}")

    def after(self, position: int, op: Op) -> None:
        self.events.append(f"{self.name}.after {position}")

    def finish(self) -> None:
        self.events.append(f"{self.name}.finish")


def test_an_overlapped_pair_runs_as_one_unit_between_both_ops_features() -> None:
    """The features see both ops of a pair before it runs and both after: the gate, the
    parameter gather of a chunk's first forward and the gradient sync keep their places."""
    events: list[str] = []
    ops = [Op(F, 0, 0), Op(F, 0, 1), Op(BW, 0, 0), Op(BW, 0, 1)]
    run = _step_run(events, ops, pair_starts={1})
    run.execute([Traced("a", events)])
    assert events == [
        "a.begin",
        "a.before 0",
        "run F0:0",
        "a.after 0",
        "reap",
        "a.before 1",
        "a.before 2",
        "pair F0:1 BW0:0",
        "a.after 1",
        "a.after 2",
        "reap",
        "a.before 3",
        "run BW0:1",
        "a.after 3",
        "reap",
        "a.finish",
    ]
    assert run.op_count == {"F": 2, "BW": 2}


def test_execute_calls_before_in_order_and_after_in_reverse() -> None:
    events: list[str] = []
    ops = [Op(F, 0, 0), Op(BW, 0, 0)]
    run = _step_run(events, ops)
    run.execute([Traced("a", events), Traced("b", events)])
    assert events == [
        "a.begin",
        "b.begin",
        "a.before 0",
        "b.before 0",
        "run F0:0",
        "b.after 0",
        "a.after 0",
        "reap",
        "a.before 1",
        "b.before 1",
        "run BW0:0",
        "b.after 1",
        "a.after 1",
        "reap",
        "a.finish",
        "b.finish",
    ]
    assert run.op_count == {"F": 1, "BW": 1}


def test_execute_names_a_failed_op_and_calls_no_after_for_it() -> None:
    events: list[str] = []
    ops = [Op(F, 0, 0), Op(BW, 0, 0)]
    run = _step_run(events, ops, fail_at=1)
    with pytest.raises(PipelineError, match=r"rank 0: op BW0:0 \(position 1\) failed: op broke"):
        run.execute([Traced("a", events)])
    assert events[-2:] == ["reap", "a.before 1"]


def test_execute_leaves_a_failure_ahead_of_the_op_unnamed() -> None:
    """What fails in ``before`` (the gate's settle) is not the op's: it passes as it is."""
    events: list[str] = []
    run = _step_run(events, [Op(F, 0, 0)])
    with pytest.raises(ValueError, match="not the op's"):
        run.execute([Traced("gate", events, fail_before=0)])
    assert "run F0:0" not in events
