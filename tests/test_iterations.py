"""Several iterations back to back (schedule/iterations.py): the iteration-boundary bubble with a
synchronous optimizer and with post-validation, at unit costs F=B=W=1."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.iterations import optimizer_steps, simulate_iterations
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


def test_the_runtimes_choices_keep_zb_h2s_bubble() -> None:
    """Partial state down from rank p-1 (what post_validation.py passes), or waiting for the
    global norm after the step (what MainGradOptimizer does): the barrier stays."""
    sync = run("zb-h2", "sync")
    assert run("zb-h2", "post-validation", chain="down").period == pytest.approx(sync.period)
    assert run("zb-h2", "post-validation-wait").period == pytest.approx(sync.period)
    assert run("zb-h2", "post-validation", chain="up").period < sync.period


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
    assert (
        main(["simulate", "--schedule", "zb-h2", "--iterations", "3", "--pp-post-validation", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)["iterations"]
    assert data["post-validation"]["period"] == 24 and data["sync"]["period"] == 27
    assert main(["simulate", "--schedule", "zb-h2", "--iterations", "0"]) != 0
