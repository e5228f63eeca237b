"""The simulator against closed forms: 1F1B's bubble and peak, memory bookkeeping, latency."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule.costs import TableCosts, UniformCosts
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Schedule
from megatron_pp_ext.schedule.simulate import simulate
from megatron_pp_ext.schedule.validate import ScheduleError


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
def test_1f1b_bubble_and_peak_are_exact(pp: int, extra: int) -> None:
    microbatches = pp + extra
    result = simulate(generate("1f1b", pp, microbatches))
    expected = (pp - 1) / (microbatches + pp - 1)
    assert result.bubble_rate == pytest.approx(expected, abs=1e-12)
    assert result.bubble_rate_per_rank == pytest.approx([expected] * pp, abs=1e-12)
    assert result.peak_memory_m[0] == pytest.approx(1.0, abs=1e-12)
    # rank r holds p - r microbatches of its 1/p of the layers
    assert result.peak_memory_m == pytest.approx([(pp - r) / pp for r in range(pp)])
    assert result.makespan == pytest.approx(3 * (microbatches + pp - 1))


def test_fewer_microbatches_than_stages() -> None:
    result = simulate(generate("1f1b", 4, 2))
    assert result.peak_memory_m[0] == pytest.approx(2 / 4)
    assert result.bubble_rate == pytest.approx(3 / 5)


def test_split_backward_keeps_the_weight_share_until_w() -> None:
    text = "pp: 1\nmicrobatches: 2\nrank 0: F0:0 F0:1 B0:0 B0:1 W0:0 W0:1\n"
    schedule = Schedule.from_text(text)
    costs = UniformCosts(num_stages=1, weight_fraction=0.25)
    result = simulate(schedule, costs)
    values = [value for _, value in result.memory_curves[0]]
    assert values == pytest.approx([0, 1, 2, 1.25, 0.5, 0.25, 0])
    assert result.peak_memory_m == [2.0]


def test_comm_latency_lengthens_the_makespan_by_the_hops() -> None:
    pp, microbatches, latency = 4, 1, 0.5
    base = simulate(generate("1f1b", pp, microbatches))
    slow = simulate(generate("1f1b", pp, microbatches), UniformCosts(num_stages=pp, comm=latency))
    # one microbatch crosses p-1 links forward and p-1 links back
    assert slow.makespan - base.makespan == pytest.approx(2 * (pp - 1) * latency)


def test_table_costs_override_per_stage() -> None:
    schedule = generate("1f1b", 2, 2)
    table = TableCosts(default=UniformCosts(num_stages=2), durations={("F", 1): 3.0, ("BW", 1): 5.0})
    result = simulate(schedule, table)
    # stage 1 is the bottleneck: 2 x (3 + 5), after the first F of stage 0
    assert result.makespan == pytest.approx(1 + 2 * (3 + 5) + 2)


def test_sliced_1f1b_holds_less_than_whole_microbatches() -> None:
    whole = simulate(generate("1f1b", 4, 8))
    sliced = simulate(generate("1f1b", 4, 8, slices=4))
    assert sliced.peak_memory_m[0] < whole.peak_memory_m[0]
    assert sliced.bubble_rate < whole.bubble_rate


def test_simulation_reports_deadlock() -> None:
    text = "pp: 2\nmicrobatches: 2\nrank 0: F0:0 BW0:0 F0:1 BW0:1\nrank 1: F1:0 F1:1 BW1:0 BW1:1\n"
    with pytest.raises(ScheduleError, match="deadlock in simulation: rank 0 waits at BW0:0 for RECV_B0:0<1"):
        simulate(Schedule.from_text(text))


def test_json_output_has_the_documented_keys() -> None:
    data = simulate(generate("1f1b", 3, 4)).to_dict()
    for key in (
        "schedule",
        "pp",
        "microbatches",
        "makespan",
        "bubble_rate",
        "bubble_rate_per_rank",
        "peak_memory_m",
    ):
        assert key in data
    assert len(data["peak_memory_m"]) == 3
