"""Activation offload in the schedule core (no torch): the OFFLOAD/RELOAD pass and its policies,
the validator's rules for copies, the simulator's copy streams and shared host links, and k."""

from __future__ import annotations

import json
import math
import re

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule.costs import UniformCosts, offload_fraction, offload_ratio
from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import OpKind, Schedule, format_op
from megatron_pp_ext.schedule.lowering import insert_offload, lower
from megatron_pp_ext.schedule.offload import (
    OffloadError,
    OffloadPolicy,
    apply_offload,
    lifespans,
    ratio_from_costs,
    select_units,
)
from megatron_pp_ext.schedule.simulate import simulate
from megatron_pp_ext.schedule.validate import ScheduleError, validate


def text_of(ops) -> str:
    return " ".join(format_op(op) for op in ops)


# ---- the pass -----------------------------------------------------------------------------------


def test_offload_goes_after_f_and_reload_one_compute_op_ahead_of_b() -> None:
    schedule = insert_offload(generate("1f1b", 4, 8))
    validate(schedule)
    assert text_of(schedule.ranks[0][:9]) == (
        "F0:0 OFFLOAD0:0 F0:1 OFFLOAD0:1 F0:2 OFFLOAD0:2 RELOAD0:0 F0:3 OFFLOAD0:3"
    )
    # the last stage runs each B right after its F: nothing to gain, no copies
    assert not any(op.is_copy for op in schedule.ranks[3])
    assert schedule.offloads and not generate("1f1b", 4, 8).offloads


def test_lowering_keeps_copies_outside_the_comm_of_their_op() -> None:
    offloaded = lower(insert_offload(generate("1f1b", 3, 6)))
    validate(offloaded)
    ops = text_of(offloaded.ranks[1])
    # the output leaves first (the next input's receive is posted before it: the message order)
    assert "F1:1 RECV_F1:2<0 SEND_F1:1>2 OFFLOAD1:1" in ops
    assert "RELOAD1:1 F1:2 SEND_F1:2>2 OFFLOAD1:2 RECV_B1:1<2 BW1:1" in ops  # before the wait
    # the pass also works on an already lowered schedule, with the same result
    assert lower(insert_offload(lower(generate("1f1b", 3, 6)))).ranks == offloaded.ranks


def test_lookahead_moves_the_reload_earlier_and_skips_short_lives() -> None:
    base = generate("1f1b", 4, 8)
    spans = lifespans(base)
    assert spans[(0, 0, 0)] == 3 and spans[(3, 5, 0)] == 0
    for lookahead in (0, 1, 2, 3):
        schedule = insert_offload(base, lookahead=lookahead)
        validate(schedule)
        offloaded = {op.unit for _, _, op in schedule.all_ops() if op.kind == OpKind.OFFLOAD}
        assert offloaded == {unit for unit, span in spans.items() if span > lookahead}
        for ops in schedule.ranks:
            compute = [op for op in ops if op.is_compute or op.kind == OpKind.RELOAD]
            for index, op in enumerate(compute):
                if op.kind == OpKind.RELOAD:
                    ahead = next(
                        i
                        for i in range(index, len(compute))
                        if compute[i].kind == OpKind.BW and compute[i].unit == op.unit
                    )
                    assert sum(1 for o in compute[index:ahead] if o.is_compute) == lookahead


def test_text_and_json_round_trip_copies() -> None:
    schedule = apply_offload(generate("interleaved-1f1b", 2, 4, vpp=2), OffloadPolicy("full"))
    assert Schedule.from_text(schedule.to_text()).ranks == schedule.ranks
    assert Schedule.from_json(schedule.to_json()).ranks == schedule.ranks


# ---- the validator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ("F0:0 F0:1 RELOAD0:0 BW0:0 BW0:1", "RELOAD0:0 at rank 0 position 2 has no OFFLOAD0:0"),
        ("F0:0 OFFLOAD0:0 F0:1 BW0:0 BW0:1", "OFFLOAD0:0 at rank 0 position 1 has no RELOAD0:0"),
        ("OFFLOAD0:0 F0:0 F0:1 RELOAD0:0 BW0:0 BW0:1", "runs before F0:0"),
        (
            "F0:0 F0:1 RELOAD0:0 OFFLOAD0:0 BW0:0 BW0:1",
            "RELOAD0:0 at rank 0 position 2 runs before OFFLOAD0:0",
        ),
        ("F0:0 OFFLOAD0:0 F0:1 BW0:0 RELOAD0:0 BW0:1", "runs after BW0:0 (position 3)"),
        ("F0:0 OFFLOAD0:0 OFFLOAD0:0 F0:1 RELOAD0:0 BW0:0 BW0:1", "appears twice"),
    ],
)
def test_validator_names_the_broken_copy_rule(ops: str, message: str) -> None:
    schedule = Schedule.from_text(f"pp: 1\nmicrobatches: 2\nrank 0: {ops}\n")
    with pytest.raises(ScheduleError, match=re.escape(message)):
        validate(schedule)


def test_copy_on_the_wrong_rank_is_refused() -> None:
    text = "pp: 2\nmicrobatches: 1\nrank 0: F0:0 OFFLOAD1:0 BW0:0\nrank 1: F1:0 RELOAD1:0 BW1:0\n"
    with pytest.raises(ScheduleError, match="OFFLOAD1:0 at rank 0 position 1: stage 1 belongs to rank 1"):
        validate(Schedule.from_text(text))


# ---- the simulator ------------------------------------------------------------------------------


def test_full_offload_in_1f1b_leaves_what_is_in_flight() -> None:
    schedule = generate("1f1b", 4, 8)
    without = simulate(schedule)
    with_copies = simulate(apply_offload(schedule, OffloadPolicy("full")))
    assert without.peak_memory_m == pytest.approx([1.0, 0.75, 0.5, 0.25])
    # rank 0: the F running plus the one unit reloaded ahead of its backward (2 of 4 units)
    assert with_copies.peak_memory_m == pytest.approx([0.5, 0.5, 0.5, 0.25])
    assert with_copies.makespan == without.makespan  # copies take no time by default
    # every unit except those whose B follows right after the next op (rank 2's first and last,
    # every unit of the last stage)
    assert with_copies.offloaded_bytes_per_rank == pytest.approx([8 / 4, 8 / 4, 6 / 4, 0])
    assert len(with_copies.copies) == 2 * (8 + 8 + 6)


def test_selective_offload_of_the_longest_lived_chunk_in_interleaved_1f1b() -> None:
    schedule = generate("interleaved-1f1b", 4, 8, vpp=2)
    spans = lifespans(schedule)
    assert min(spans[(0, mb, 0)] for mb in range(8)) > max(spans[(4, mb, 0)] for mb in range(8))
    selected = select_units(schedule, OffloadPolicy("selective"))
    assert selected == {(stage, mb, 0) for stage in range(4) for mb in range(8)}  # chunk 0
    without = simulate(schedule).peak_memory_m
    selective = simulate(apply_offload(schedule, OffloadPolicy("selective"))).peak_memory_m
    full = simulate(apply_offload(schedule, OffloadPolicy("full"))).peak_memory_m
    # rank 0 holds 11 units of M/8 without copies; with chunk 0 offloaded, the 4 chunk-1 units of
    # a microbatch group plus two reloaded chunk-0 units; with everything offloaded, two units
    assert without[0] == pytest.approx(11 / 8)
    assert selective[0] == pytest.approx(6 / 8)
    assert selective[0] < 0.55 * without[0]
    assert full == pytest.approx([2 / 8] * 4)
    # offloading chunk 1 instead frees less: its units are not the ones alive at the peak
    other = simulate(apply_offload(schedule, OffloadPolicy("selective", chunks=(1,)))).peak_memory_m
    assert other[0] > selective[0]


def test_copy_time_delays_the_backward_on_one_rank() -> None:
    # copies of one unit take 2 time units; F = B = W = 1
    schedule = Schedule.from_text(
        "pp: 1\nmicrobatches: 2\nrank 0: F0:0 OFFLOAD0:0 F0:1 RELOAD0:0 BW0:1 BW0:0\n"
    )
    result = simulate(schedule, UniformCosts(num_stages=1, host_bandwidth=0.5))
    times = {format_op(e.op): (e.start, e.end) for e in result.events + result.copies}
    assert times["OFFLOAD0:0"] == (1, 3)
    assert times["RELOAD0:0"] == (3, 5)  # waits for the offload, not only for its turn
    assert times["BW0:1"] == (2, 4)
    assert times["BW0:0"] == (5, 7)  # waits for the reload: one unit of bubble
    assert result.makespan == 7 and result.bubble_rate == pytest.approx(1 / 7)


def test_a_shared_host_link_serialises_copies_and_shows_as_bubble() -> None:
    schedule = apply_offload(generate("1f1b", 4, 8), OffloadPolicy("full"))
    fast = simulate(schedule, UniformCosts(num_stages=4))
    # a unit (M/4) takes 2 time units to copy, longer than the forward its reload overlaps
    own = simulate(schedule, UniformCosts(num_stages=4, host_bandwidth=0.125))
    shared = simulate(schedule, UniformCosts(num_stages=4, host_bandwidth=0.125, ranks_per_host=4))
    assert fast.bubble_rate < own.bubble_rate < shared.bubble_rate
    assert fast.makespan < own.makespan < shared.makespan
    for kind in (OpKind.OFFLOAD, OpKind.RELOAD):
        spans = sorted((e.start, e.end) for e in shared.copies if e.op.kind == kind)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        spans = sorted((e.start, e.end) for e in own.copies if e.op.kind == kind)
        assert any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # in parallel


def test_offload_frees_memory_only_when_its_copy_ends() -> None:
    text = "pp: 1\nmicrobatches: 3\nrank 0: F0:0 OFFLOAD0:0 F0:1 BW0:1 F0:2 BW0:2 RELOAD0:0 BW0:0\n"
    schedule = Schedule.from_text(text)
    quick = simulate(schedule, UniformCosts(num_stages=1))
    slow = simulate(schedule, UniformCosts(num_stages=1, host_bandwidth=0.25))  # a copy takes 4
    assert quick.peak_memory_m == [1.0]
    assert slow.peak_memory_m == [2.0]  # unit 0 is still on the device while F0:1 runs


# ---- k and auto ---------------------------------------------------------------------------------


def test_offload_ratio_is_pipeoffloads_formula() -> None:
    # Llama-7B (h=4096) at 4K tokens, 200 TFLOP/s delivered, 25 GB/s: 10/(3*28672) * 8000
    assert offload_ratio(4096, 4096, 200e12, 25e9) == pytest.approx(10 / (3 * 28672) * 8000)
    assert offload_ratio(4096, 32768, 200e12, 25e9) < offload_ratio(4096, 4096, 200e12, 25e9)
    assert offload_ratio(8192, 4096, 200e12, 25e9) < offload_ratio(4096, 4096, 200e12, 25e9)
    assert offload_fraction(0.8) == 1.0 and offload_fraction(4.0) == 0.25
    with pytest.raises(ValueError):
        offload_ratio(4096, 4096, 200e12, 0)
    schedule = generate("1f1b", 4, 8)
    costs = flop_costs_for("llama-7b", schedule, 16384, host_bandwidth=25e9)
    assert costs.offload_ratio() == pytest.approx(offload_ratio(4096, 16384, 200e12, 25e9))
    shared = flop_costs_for("llama-7b", schedule, 16384, host_bandwidth=25e9, ranks_per_host=2)
    assert shared.offload_ratio() == pytest.approx(2 * costs.offload_ratio())


def test_auto_offloads_everything_below_k_1_and_the_longest_lived_share_above() -> None:
    schedule = generate("interleaved-1f1b", 4, 8, vpp=2)
    assert select_units(schedule, OffloadPolicy("auto", ratio=0.9)) is None
    half = select_units(schedule, OffloadPolicy("auto", ratio=2.0))
    assert half == select_units(schedule, OffloadPolicy("selective"))  # chunk 0 lives longest
    quarter = select_units(schedule, OffloadPolicy("auto", ratio=4.0))
    assert len(quarter) == 4 * 4 and quarter < half
    copies = apply_offload(schedule, OffloadPolicy("auto", ratio=2.0))
    assert copies.meta["offload"] == "auto" and copies.meta["offload_k"] == 2.0
    with pytest.raises(OffloadError, match="auto needs k"):
        select_units(schedule, OffloadPolicy("auto"))


def test_ratio_from_unit_costs() -> None:
    schedule = generate("1f1b", 2, 4)
    # a unit's activation is 1/2 M, copied at 1/4 M per time unit: 2 time units vs F+B+W = 3
    assert ratio_from_costs(schedule, UniformCosts(num_stages=2, host_bandwidth=0.25)) == pytest.approx(2 / 3)
    assert ratio_from_costs(schedule, UniformCosts(num_stages=2)) == 0.0


def test_policy_errors_name_their_flag() -> None:
    schedule = generate("1f1b", 4, 8)
    with pytest.raises(OffloadError, match="chunk 1 does not exist") as error:
        select_units(schedule, OffloadPolicy("selective", chunks=(1,)))
    assert error.value.flag == "--pp-offload-chunks"
    with pytest.raises(OffloadError, match="needs --pp-offload selective"):
        OffloadPolicy("full", chunks=(0,))
    with pytest.raises(OffloadError, match="unknown offload policy"):
        OffloadPolicy("half")


# ---- the command --------------------------------------------------------------------------------


def test_simulate_command_shows_peaks_with_and_without_offload(capsys) -> None:
    args = ["simulate", "--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "8"]
    assert main([*args, "--pp-offload", "selective", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peak_memory_m"][0] == pytest.approx(0.75)
    assert data["without_offload"]["peak_memory_m"][0] == pytest.approx(1.375)
    assert main([*args, "--pp-offload", "auto", "--model", "llama-7b", "--seq-length", "16384"]) == 0
    out = capsys.readouterr().out
    k = offload_ratio(4096, 16384, 200e12, 50e9)
    assert f"offload auto k={k:.3g}" in out and "r0: peak 1.375M -> " in out
    assert main([*args, "--pp-offload", "selective", "--pp-offload-chunks", "2"]) == 2
    assert "--pp-offload-chunks" in capsys.readouterr().err
    assert main([*args, "--pp-offload", "full", "--pp-host-bandwidth", "0"]) == 2
    assert math.isfinite(k)
