"""Several iterations back to back (schedule/iterations.py): the iteration-boundary bubble with a
synchronous optimizer and with post-validation, at unit costs F=B=W=1."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.gate import validation_gate
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Schedule
from megatron_pp_ext.schedule.iterations import (
    completion_order,
    gate_positions,
    optimizer_steps,
    simulate_iterations,
)
from megatron_pp_ext.schedule.lowering import insert_offload, lower
from megatron_pp_ext.schedule.simulate import simulate


def run(name: str, optimizer: str, p: int = 4, m: int = 8, **kwargs: object):
    return simulate_iterations(generate(name, p, m), iterations=3, optimizer=optimizer, **kwargs)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24)])
def test_zb_h1_sync_boundary_bubble_is_the_closed_form(p: int, m: int) -> None:
    result = run("zb-h1", "sync", p, m)
    assert result.period == pytest.approx(3 * m + p - 1)
    assert result.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24)])
def test_post_validation_takes_back_zb_h2s_boundary_bubble(p: int, m: int) -> None:
    h1_sync, h2_sync = run("zb-h1", "sync", p, m), run("zb-h2", "sync", p, m)
    h1_post, h2_post = run("zb-h1", "post-validation", p, m), run("zb-h2", "post-validation", p, m)
    assert h2_sync.period == pytest.approx(h1_sync.period)  # synchronous: H2 is no better than H1
    assert h2_sync.bubble_rate == pytest.approx(h1_sync.bubble_rate)
    assert h2_post.period == pytest.approx(3 * m)  # no bubble left at all in the steady state
    assert h2_post.bubble_rate == pytest.approx(0.0, abs=1e-9)
    assert h2_post.time_per_iteration < h1_post.time_per_iteration
    assert h2_post.bubble_rate < h1_post.bubble_rate
    assert h1_post.period == pytest.approx(h1_sync.period)  # every ZB-H1 rank ends together


@pytest.mark.parametrize("p, m, sync_period", [(4, 8, 25.5), (8, 24, 75.5)])
def test_v_zb_post_validation_leaves_no_bubble(p: int, m: int, sync_period: float) -> None:
    """V-ZB has no idle inside any rank's span, so once the optimizer step stops being a barrier
    the steady state is 3m per iteration; synchronously the boundary still costs a little."""
    sync, post = run("v-zb", "sync", p, m), run("v-zb", "post-validation", p, m)
    assert sync.period == pytest.approx(sync_period)
    assert post.period == pytest.approx(3 * m)
    assert post.bubble_rate == pytest.approx(0.0, abs=1e-9)
    assert sync.bubble_rate > 0.0


def test_1f1b_gains_nothing() -> None:
    sync, post = run("1f1b", "sync"), run("1f1b", "post-validation")
    assert post.period == pytest.approx(sync.period) == pytest.approx(33.0)  # 3m + 3(p-1) with BW=2


def test_the_comparison_modes_keep_zb_h2s_bubble() -> None:
    """Partial state down from rank p-1 (against ZB-H2's completion order), or waiting for the
    global norm inside the step: the barrier stays. The runtime's order (auto) is the paper's."""
    sync = run("zb-h2", "sync")
    assert run("zb-h2", "post-validation", chain="down").period == pytest.approx(sync.period)
    assert run("zb-h2", "post-validation-wait").period == pytest.approx(sync.period)
    assert run("zb-h2", "post-validation", chain="up").period < sync.period
    assert run("zb-h2", "post-validation").chain == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "name, chain",
    [("zb-h2", [0, 1, 2, 3]), ("v-zb", [0, 1, 2, 3]), ("1f1b", [3, 2, 1, 0]), ("zb-h1", [3, 2, 1, 0])],
)
def test_completion_order_is_the_auto_chain(name: str, chain: list[int]) -> None:
    """train passes the partial state in completion_order: the simulator's auto chain."""
    assert completion_order(generate(name, 4, 8)) == chain
    assert run(name, "post-validation").chain == chain


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24)])
@pytest.mark.parametrize("name", ["zb-h2", "v-zb"])
def test_the_gate_does_not_bind_without_reduce_time(name: str, p: int, m: int) -> None:
    """With the all-reduce free, every gate op waits for a forward of the rank that ended last,
    which starts after the all-reduce anyway: 3m per iteration, gates in place (not at 0)."""
    schedule = generate(name, p, m)
    result = simulate_iterations(schedule, iterations=3, optimizer="post-validation", reduce_time=0.0)
    assert result.gate_positions == validation_gate(lower(schedule)).positions
    assert min(result.gate_positions) > 0
    assert result.period == pytest.approx(3 * m)
    assert result.gates[1] == [max(end for _, end in result.steps[0])] * p  # opens at iteration 1's end


def test_the_gate_binds_when_the_all_reduce_is_slow() -> None:
    """ZB-H2 p=4 m=8: rank 3's first B comes one F after its start, so a global all-reduce of 5
    holds it at the gate (4 units later): the period grows by 4, still below sync's (+5)."""
    post = run("zb-h2", "post-validation", reduce_time=5.0)
    sync = run("zb-h2", "sync", reduce_time=5.0)
    assert 24.0 < post.period <= sync.period
    assert post.period == pytest.approx(28.0) and sync.period == pytest.approx(32.0)
    gate = post.gates[1][3]
    assert gate == pytest.approx(max(end for _, end in post.steps[0]) + 5.0)
    first_b = next(e for e in post.runs[1].events if e.rank == 3 and e.op.kind.value == "B")
    assert first_b.start == pytest.approx(gate)  # exactly at the gate: it bound
    assert all(e.start >= gate - 1e-9 for e in post.runs[1].events if e.op.kind.value != "F")
    # below the slack nothing changes
    assert run("zb-h2", "post-validation", reduce_time=1.0).period == pytest.approx(24.0)


def test_post_validation_hides_the_all_reduce_under_1f1b() -> None:
    """1F1B's ranks restart together, but their first backward is far enough into the next
    iteration that a short global all-reduce is over before any rank reaches its gate."""
    sync, post = run("1f1b", "sync", reduce_time=2.0), run("1f1b", "post-validation", reduce_time=2.0)
    assert sync.period == pytest.approx(35.0)
    assert post.period == pytest.approx(33.0)


@pytest.mark.parametrize("schedule", [insert_offload(generate("zb-h2", 4, 8)), generate("zb-h2", 4, 8)])
def test_gate_at_the_start_is_the_wait_for_the_global_norm(schedule: Schedule) -> None:
    """Activation copies (and vocabulary ops, attention redistribution) put the gate before the
    first op, as the runtime does: the next iteration waits for the global check, like a step
    that waits for it; only the step itself overlaps."""
    at_start = None if schedule.offloads else True
    kwargs = {"iterations": 3, "reduce_time": 2.0, "optimizer_time": 1.0}
    post = simulate_iterations(schedule, optimizer="post-validation", gate_at_start=at_start, **kwargs)
    wait = simulate_iterations(schedule, optimizer="post-validation-wait", **kwargs)
    sync = simulate_iterations(schedule, optimizer="sync", **kwargs)
    assert post.gate_positions == [0, 0, 0, 0]
    assert post.period == pytest.approx(wait.period)
    assert post.period < sync.period  # the step overlaps the all-reduce
    assert gate_positions(schedule, at_start) == [0, 0, 0, 0]


def test_the_first_iteration_has_no_gate() -> None:
    schedule = generate("zb-h2", 4, 8)
    result = simulate_iterations(schedule, iterations=1, optimizer="post-validation", reduce_time=50.0)
    assert result.gates == [[0.0] * 4]
    assert result.makespan == pytest.approx(simulate(schedule).makespan)


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "v-zb"])
def test_one_iteration_is_the_single_replay_plus_the_step(name: str) -> None:
    schedule = generate(name, 4, 8)
    single = simulate(schedule).makespan
    one = simulate_iterations(schedule, iterations=1, optimizer="sync", optimizer_time=2.0, reduce_time=0.5)
    assert one.makespan == pytest.approx(single + 2.5)
    assert one.runs[0].busy_per_rank == simulate(schedule).busy_per_rank


def test_iterations_chain_exactly_with_p2p_latency() -> None:
    """With a comm latency every iteration after the first is the first shifted by the period:
    the rank start offsets reproduce the single replay's timing."""
    schedule = generate("zb-h1", 4, 8)
    costs = UniformCosts(num_stages=4, comm=0.25)
    result = simulate_iterations(schedule, costs, iterations=3, optimizer="sync", optimizer_time=1.0)
    first = sorted((e.rank, round(e.start, 9)) for e in result.runs[0].events)
    third = sorted((e.rank, round(e.start - 2 * result.period, 9)) for e in result.runs[2].events)
    assert third == first
    assert result.period == pytest.approx(simulate(schedule, costs).makespan + 1.0)


def test_optimizer_steps_partial_chain() -> None:
    ends = [10.0, 11.0, 12.0, 13.0]
    steps, starts = optimizer_steps(ends, "post-validation", 1.0, 0.5, 0.25, [0, 1, 2, 3])
    assert [s for s, _ in steps] == [10.0, 11.0, 12.0, 13.0]
    steps, starts = optimizer_steps(ends, "post-validation", 1.0, 0.5, 0.25, [3, 2, 1, 0])
    assert [s for s, _ in steps] == [13.75, 13.5, 13.25, 13.0] and starts[0] == 14.75
    _, starts = optimizer_steps(ends, "post-validation-wait", 1.0, 2.0, 0.25, [0, 1, 2, 3])
    assert starts == [15.0, 15.0, 15.0, 15.0]  # the global norm at 13 + 2 is later than the steps
    _, starts = optimizer_steps(ends, "sync", 1.0, 0.5)
    assert starts == [14.5] * 4


def test_cli_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "zb-h2", "--iterations", "3", "--pp-post-validation"]) == 0
    out = capsys.readouterr().out
    assert "synchronous optimizer: per iteration 27 (steady)" in out
    assert "post-validation: per iteration 24 (steady)" in out
    assert "waiting for the global norm in the step: per iteration 27 (steady)" in out
    assert "train today" not in out
    assert (
        main(["simulate", "--schedule", "zb-h2", "--iterations", "3", "--pp-post-validation", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)["iterations"]
    assert data["post-validation"]["period"] == 24 and data["sync"]["period"] == 27
    assert main(["simulate", "--schedule", "zb-h2", "--iterations", "0"]) != 0
