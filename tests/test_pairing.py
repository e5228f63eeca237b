"""Overlapped F&B pairs in the schedule core (``schedule/pairing.py``): which ops pair, that a
paired schedule lowers to one that cannot deadlock (its receives before the pair, its sends
after), and the simulator's time: the pair's computes serialised, each op's expert all-to-all
hidden behind the other's compute."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule import pairing, pairs
from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.generators import SCHEDULES, generate
from megatron_pp_ext.schedule.ir import OpKind
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.nccl_check import check_nccl
from megatron_pp_ext.schedule.simulate import simulate
from megatron_pp_ext.schedule.validate import validate

PAIRING = ["1f1b", "zb-h1", "zb-h2", "v-half", "v-zb", "dualpipev", "interleaved-1f1b"]


def _schedule(name: str, pp: int, microbatches: int):
    spec = SCHEDULES[name]
    m = max(microbatches, spec.min_microbatches(pp, spec.default_vpp, 1))
    return generate(name, pp, m, vpp=spec.default_vpp, slices=1)


def _costs(schedule, expert_comm: float) -> UniformCosts:
    return UniformCosts(
        num_stages=schedule.num_stages,
        chunks_per_rank=schedule.vpp,
        forward=1.0,
        backward=1.0,
        weight=1.0,
        expert_comm=expert_comm,
    )


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("name", PAIRING)
def test_pairs_are_adjacent_forward_and_backward_of_other_microbatches(name: str, pp: int) -> None:
    schedule = pairing.pair(_schedule(name, pp, 2 * pp + 1))
    for rank, first, second in pairs.iter_pairs(schedule):
        kinds = {first[0], second[0]}
        assert OpKind.F.value in kinds and kinds & {OpKind.B.value, OpKind.BW.value}, (rank, first, second)
        assert first[2] != second[2], (rank, first, second)  # microbatches
        compute = [pairs.key_of(op) for op in schedule.ranks[rank] if op.is_compute]
        assert compute.index(second) == compute.index(first) + 1, (rank, first, second)
    keys = [k for rank, first, second in pairs.iter_pairs(schedule) for k in ((rank, first), (rank, second))]
    assert len(keys) == len(set(keys)), "an op in two pairs"


def test_pairs_shorten_dualpipev_and_interleaved_1f1b_not_plain_1f1b() -> None:
    """With the all-to-all as long as the compute, DualPipeV's two directions and interleaved
    1F1B's chunks give pairs whose inputs are ready: the step gets shorter. In plain 1F1B a
    rank's neighbouring F and B wait on each other's neighbours, so no pair shortens it (why
    megatron-core's combined 1F1B needs virtual stages with PP > 1)."""
    ratios = {}
    for name in ("dualpipev", "interleaved-1f1b", "1f1b"):
        plain = _schedule(name, 4, 12)
        costs = _costs(plain, 1.0)
        ratios[name] = simulate(pairing.pair(plain, costs), costs).makespan / simulate(plain, costs).makespan
    assert ratios["dualpipev"] < 0.85 and ratios["interleaved-1f1b"] < 0.9, ratios
    assert ratios["1f1b"] == pytest.approx(1.0), ratios


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("name", PAIRING)
def test_a_paired_schedule_lowers_to_a_valid_one_with_receives_before_and_sends_after(
    name: str, pp: int
) -> None:
    schedule = pairing.pair(_schedule(name, pp, 2 * pp + 1))
    lowered = lower(schedule)
    validate(lowered)  # the execution check replays the order: no deadlock
    assert check_nccl(lowered, strict=True, warmed=True) is None  # nor under NCCL's in-order rule
    for rank, first, second in pairs.iter_pairs(lowered):
        ops = lowered.ranks[rank]
        keys = [pairs.key_of(op) for op in ops]
        start, end = keys.index(first), keys.index(second)
        assert all(not op.is_compute for op in ops[start + 1 : end]), (rank, ops[start : end + 1])
        between = ops[start + 1 : end]
        assert not [op for op in between if op.kind in (OpKind.RECV_F, OpKind.RECV_B)], (rank, between)
        assert not [op for op in between if op.kind in (OpKind.SEND_F, OpKind.SEND_B)], (rank, between)


@pytest.mark.parametrize("name", PAIRING)
def test_pairing_hides_each_paired_op_s_all_to_all_behind_its_partner(name: str) -> None:
    """With an all-to-all shorter than either compute, a pair hides both of its all-to-alls:
    the busy time drops by exactly 2 x (all-to-all) x pairs; the step gets no longer."""
    plain = _schedule(name, 4, 12)
    comm = 0.3 / plain.vpp  # per op: under a stage's compute (1/v)
    costs = _costs(plain, 0.3)
    paired = pairing.pair(plain, costs)
    unpaired = simulate(plain, costs)
    overlapped = simulate(paired, costs)
    per_op = costs.expert_comm_time(plain.ranks[0][0])
    assert per_op == pytest.approx(comm)
    saved = sum(unpaired.busy_per_rank) - sum(overlapped.busy_per_rank)
    assert saved == pytest.approx(2 * per_op * pairs.count(paired))
    assert overlapped.makespan <= unpaired.makespan + 1e-9
    if name == "dualpipev":
        assert overlapped.makespan < unpaired.makespan


def test_without_an_all_to_all_pairing_costs_nothing_on_busy_time() -> None:
    plain = _schedule("dualpipev", 4, 12)
    costs = _costs(plain, 0.0)
    assert sum(simulate(pairing.pair(plain), costs).busy_per_rank) == sum(
        simulate(plain, costs).busy_per_rank
    )


def test_simulate_reports_the_pairs_and_the_makespan_without_them(capsys) -> None:
    """The table's last two columns: pairs taken, and the makespan without them (longer)."""
    from megatron_pp_ext.cli import main

    argv = [
        "simulate",
        "--schedule",
        "dualpipev",
        "--pp",
        "4",
        "--microbatches",
        "12",
        "--pp-expert-comm",
        "1",
    ]
    assert main([*argv, "--overlap-moe-expert-parallel-comm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    assert lines[header].split()[-3:] == ["pairs", "unpaired:", "makespan"], lines[header]
    values = lines[header + 2].split()
    assert values[0] == "dualpipev" and int(values[-2]) > 0
    assert float(values[-1]) > float(values[3])  # unpaired makespan > makespan
