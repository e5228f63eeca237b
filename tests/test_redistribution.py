"""SlimPipe's attention workload redistribution in the simulator: heavy ranks hand part of their
attention to light partners at each lock-step slot, total work stays the same, and the bubble of
uniform-slice schedules drops."""

from __future__ import annotations

import subprocess

import pytest
from cli_runner import run_cli

from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import OpKind
from megatron_pp_ext.schedule.redistribute import (
    attention_time,
    attention_work,
    delegation_plan,
    lockstep_slots,
    plan_links,
    planned_costs,
    redistribute,
)
from megatron_pp_ext.schedule.simulate import simulate

# (schedule, p, m, k, model, sequence length): SlimPipe at 64K and 128K, and Seq1F1B cut
# uniformly (its balanced cut already evens the slices out).
CASES = [
    ("slimpipe", 4, 8, 8, "llama-7b", 65536),
    ("slimpipe", 8, 8, 16, "llama-70b", 131072),
    ("seq1f1b", 4, 4, 8, "llama-7b", 32768),
]


def bubbles(name: str, pp: int, m: int, k: int, model: str, seq: int, cap: float) -> tuple[float, float]:
    schedule = generate(name, pp, m, slices=k)
    costs = flop_costs_for(model, schedule, seq, partition="uniform")
    return simulate(schedule, costs).bubble_rate, simulate(
        schedule, redistribute(schedule, costs, cap)
    ).bubble_rate


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-p{c[1]}-k{c[3]}-{c[5] // 1024}K" for c in CASES])
def test_redistribution_lowers_the_bubble(case: tuple) -> None:
    without, with_ = bubbles(*case, cap=0.1)
    assert with_ < without - 0.01, (without, with_)


def test_moves_go_from_heavy_to_light_within_the_cap_and_keep_the_work() -> None:
    schedule = generate("slimpipe", 4, 8, slices=8)
    costs = flop_costs_for("llama-7b", schedule, 65536, partition="uniform")
    cap = 0.25
    moved = redistribute(schedule, costs, cap)
    assert moved.moved
    slots = {op: slot for (_, op), slot in lockstep_slots(schedule, costs).items()}
    for heavy, light, share in moved.moved:
        assert slots[heavy] == slots[light] and heavy.stage != light.stage
        heavy_time, light_time = attention_time(costs, heavy), attention_time(costs, light)
        assert 0 < share <= min(cap * heavy_time, (heavy_time - light_time) / 2) + 1e-12
    base, after = simulate(schedule, costs), simulate(schedule, moved)
    assert sum(after.busy_per_rank) == pytest.approx(sum(base.busy_per_rank), rel=1e-12)
    assert after.peak_memory_per_rank == base.peak_memory_per_rank
    off = simulate(schedule, redistribute(schedule, costs, 0.0))
    assert off.makespan == base.makespan and off.busy_per_rank == base.busy_per_rank


def test_later_uniform_slices_carry_more_attention() -> None:
    schedule = generate("slimpipe", 4, 2, slices=4)
    costs = flop_costs_for("llama-7b", schedule, 16384, partition="uniform")
    forwards = [op for op in schedule.ranks[0] if op.kind.value == "F" and op.microbatch == 0]
    times = [attention_time(costs, op) for op in forwards]
    # slice j attends to (j + 1/2) c^2 pairs (plus the diagonal): ratios 1 : 3 : 5 : 7
    assert [round(t / times[0], 2) for t in times] == pytest.approx([1, 3, 5, 7], rel=0.01)


def simulate_cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["simulate", *args], timeout=120)


def test_simulate_flag_reports_the_bubble_with_and_without() -> None:
    base = ["--schedule", "slimpipe", "--pp", "4", "--microbatches", "8", "--slices", "8"]
    done = simulate_cli(
        *base, "--model", "llama-7b", "--seq-length", "65536", "--pp-attn-redistribution", "0.1"
    )
    assert done.returncode == 0, done.stderr
    assert "attention redistribution (cap 0.1): bubble 0.095 without -> 0.078 with" in done.stdout
    # a whole 8K slice is more than 10% of any slice's attention here: the runtime moves nothing
    assert "as the runtime moves it (whole oldest K/V slices): bubble 0.095" in done.stdout
    refused = simulate_cli(*base, "--pp-attn-redistribution", "0.1")
    assert refused.returncode == 2 and "--pp-attn-redistribution" in refused.stderr


# ---- the delegation plan for real ranks ------------------------------------------------------
PLAN_CASES = [("slimpipe", 2, 3, 4), ("slimpipe", 3, 4, 8), ("slimpipe", 4, 5, 8), ("seq1f1b", 4, 4, 8)]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[f"{c[0]}-p{c[1]}-k{c[3]}" for c in PLAN_CASES])
@pytest.mark.parametrize("cap", [0.25, 0.5, 1.0])
def test_plan_moves_whole_oldest_slices_from_the_heavier_op_within_the_cap(case: tuple, cap: float) -> None:
    name, pp, m, k = case
    schedule = generate(name, pp, m, slices=k)
    lengths = [512 // k] * k
    layers = [2 + stage % 2 for stage in range(schedule.num_stages)]  # uneven on purpose
    plan = delegation_plan(schedule, lengths, cap, layers)
    assert plan == delegation_plan(schedule, lengths, cap, layers)  # every rank gets the same
    slots = lockstep_slots(schedule, None)
    ranks = {op: rank for rank, ops in enumerate(schedule.ranks) for op in ops}
    for (rank, heavy), delegation in plan.items():
        assert ranks[heavy] == rank and heavy.kind != OpKind.W
        assert delegation.partner != rank and ranks[delegation.light] == delegation.partner
        assert slots[(rank, heavy)] == slots[(delegation.partner, delegation.light)]
        assert 1 <= delegation.oldest_slices <= heavy.slice
        heavy_work = attention_work(heavy, lengths, layers)
        light_work = attention_work(delegation.light, lengths, layers)
        assert heavy_work > light_work  # the heavier op is always the one that hands work away
        assert 0 < delegation.work <= min((heavy_work - light_work) / 2, cap * heavy_work)
        # one more slice would have gone over the budget (or there is none left)
        per_slice = delegation.work // sum(lengths[: delegation.oldest_slices]) * lengths[0]
        more = delegation.work + per_slice
        assert delegation.oldest_slices == heavy.slice or more > min(
            (heavy_work - light_work) / 2, cap * heavy_work
        )
    assert plan_links(plan) == sorted({(r, d.partner) for (r, _), d in plan.items()})


def test_plan_is_empty_when_off_or_unsliced_and_refuses_a_bad_cap() -> None:
    schedule = generate("slimpipe", 4, 5, slices=8)
    assert delegation_plan(schedule, [16] * 8, 0.0) == {}
    assert delegation_plan(generate("1f1b", 4, 5), [128], 0.5) == {}
    assert delegation_plan(schedule, [16] * 8, 0.5)
    for cap in (-0.1, 1.5):
        with pytest.raises(ValueError, match="--pp-attn-redistribution"):
            delegation_plan(schedule, [16] * 8, cap)
    with pytest.raises(ValueError, match="4 slice lengths"):
        delegation_plan(schedule, [32] * 4, 0.5)


def test_plan_evens_out_the_attention_of_each_slot() -> None:
    """Work per rank per lock-step slot after the planned moves: the slowest rank of a slot
    carries less than without them."""
    schedule = generate("slimpipe", 4, 5, slices=8)
    lengths = [64] * 8
    plan = delegation_plan(schedule, lengths, 0.5)
    slots = lockstep_slots(schedule, None)

    def critical_path(moves: dict) -> int:
        per_slot: dict[int, dict[int, int]] = {}
        for (rank, op), slot in slots.items():
            per_slot.setdefault(slot, {}).setdefault(rank, 0)
            per_slot[slot][rank] += attention_work(op, lengths)
        for (rank, op), delegation in moves.items():
            per_slot[slots[(rank, op)]][rank] -= delegation.work
            per_slot[slots[(rank, op)]][delegation.partner] += delegation.work
        return sum(max(work.values()) for work in per_slot.values())

    assert critical_path(plan) < 0.93 * critical_path({})


def test_the_runtime_plan_in_the_simulator_keeps_the_work_and_lowers_the_bubble() -> None:
    schedule = generate("slimpipe", 4, 8, slices=8)
    costs = flop_costs_for("llama-7b", schedule, 65536, partition="uniform")
    planned = planned_costs(schedule, costs, 0.25)
    base, after = simulate(schedule, costs), simulate(schedule, planned)
    assert sum(after.busy_per_rank) == pytest.approx(sum(base.busy_per_rank), rel=1e-12)
    assert after.bubble_rate < base.bubble_rate - 0.01, (base.bubble_rate, after.bubble_rate)


def test_taken_where_communication_completes_in_launch_order(monkeypatch) -> None:
    """The light op serves its partner inside its own op and the message order places the pair's
    exchange (test_nccl_check's sweep), so in-order completion (--pp-emulate-nccl, a GPU with
    CUDA_DEVICE_MAX_CONNECTIONS=1) takes the flag like any other."""
    from megatron_pp_ext.megatron.hook import PipelineOptions

    sliced = dict(schedule="slimpipe", slices=4, attn_redistribution=0.5)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for emulate in (False, True):
        assert PipelineOptions(**sliced, emulate_nccl=emulate).schedule_for(2, 4).slices == 4
