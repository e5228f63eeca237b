"""Schedule generators: every one valid over a sweep of sizes, impossible requests named, the
unit-cost numbers of the papers reached (as far as we reach them), and large requests complete."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedule.generators import SCHEDULES, RequestError, generate
from megatron_pp_ext.schedule.generators.request import Costs
from megatron_pp_ext.schedule.ir import Op, OpKind, Schedule
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.simulate import SimResult, simulate
from megatron_pp_ext.schedule.validate import ScheduleError, validate

NAMES = sorted(SCHEDULES)


def vpps(name: str) -> tuple[int, ...]:
    allowed = SCHEDULES[name].allowed_vpp
    return allowed if allowed is not None else (2,)


def smallest_m(name: str, pp: int, vpp: int, slices: int) -> int:
    return SCHEDULES[name].min_microbatches(pp, vpp, slices)


def check(schedule: Schedule) -> None:
    validate(schedule)
    validate(lower(schedule))


def rank_span_bubble(result: SimResult) -> float:
    """Mean over ranks of idle / (last op end - first op start): the papers' 'steady' bubble,
    which does not count the ramp every pipeline needs before its last rank gets work."""
    rates = []
    for rank in range(result.schedule.pp):
        events = [e for e in result.events if e.rank == rank]
        span = max(e.end for e in events) - min(e.start for e in events)
        rates.append(1 - result.busy_per_rank[rank] / span)
    return sum(rates) / len(rates)


# ---- validity -------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", range(2, 9))
@pytest.mark.parametrize("name", NAMES)
def test_sweep_is_valid_and_lowers_cleanly(name: str, pp: int) -> None:
    """m from p to 4p (and below p where the schedule allows it), v in {1, 2} where allowed,
    k in {1, 2, 4, 8}; large m*k combinations are left to the hypothesis test."""
    spec = SCHEDULES[name]
    checked = 0
    for vpp in vpps(name):
        for slices in (1, 2, 4, 8):
            if slices < spec.min_slices(pp, vpp):
                continue
            low = smallest_m(name, pp, vpp, slices)
            for m in sorted({1, pp - 1, pp, 2 * pp + 1, 4 * pp}):
                if m < low or m * slices > 8 * pp:
                    continue
                schedule = generate(name, pp, m, vpp=vpp, slices=slices)
                try:
                    check(schedule)
                except ScheduleError as error:  # pragma: no cover - the message is the point
                    raise AssertionError(f"{name} p={pp} m={m} v={vpp} k={slices}: {error}") from error
                assert schedule.pp == pp and schedule.microbatches == m and schedule.slices == slices
                assert schedule.placement.style == spec.placement
                checked += 1
    assert checked > 0


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, int, int, int, int]:
    name = draw(st.sampled_from(NAMES))
    pp = draw(st.integers(1, 8))
    vpp = draw(st.sampled_from(vpps(name) if SCHEDULES[name].allowed_vpp else (2, 3)))
    slices = draw(st.integers(max(1, SCHEDULES[name].min_slices(pp, vpp)), 8))
    low = smallest_m(name, pp, vpp, slices)
    m = draw(st.integers(low, max(low, 4 * pp + 3)))
    return name, pp, m, vpp, slices


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_any_valid_request_gives_a_valid_schedule(request: tuple[str, int, int, int, int]) -> None:
    name, pp, m, vpp, slices = request
    schedule = generate(name, pp, m, vpp=vpp, slices=slices)
    check(schedule)
    computes = sum(len(schedule.compute_ops(rank)) for rank in range(pp))
    assert computes >= 2 * schedule.num_stages * m * slices


@settings(max_examples=25, deadline=None)
@given(
    pp=st.integers(1, 6),
    m=st.integers(1, 16),
    slices=st.integers(1, 4),
    forward=st.floats(0.2, 3.0),
    backward=st.floats(0.2, 3.0),
    weight=st.floats(0.1, 3.0),
    comm=st.floats(0.0, 1.0),
    limit=st.one_of(st.none(), st.floats(1.0, 3.0)),
)
def test_zb_auto_is_valid_for_any_costs_and_keeps_its_memory_limit(
    pp: int,
    m: int,
    slices: int,
    forward: float,
    backward: float,
    weight: float,
    comm: float,
    limit: float | None,
) -> None:
    costs = Costs(forward=forward, backward=backward, weight=weight, comm=comm)
    schedule = generate("zb-auto", pp, m, slices=slices, costs=costs, memory_limit=limit)
    check(schedule)
    peak = max(simulate(schedule).peak_memory_m)
    assert peak <= (1.0 if limit is None else limit) + 1e-9


# ---- impossible requests name the flag ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "flag"),
    [
        ("dualpipev", {"pp": 4, "microbatches": 7}, "--microbatches"),
        ("dualpipev", {"pp": 4, "microbatches": 2, "slices": 2}, "--microbatches"),
        ("interleaved-1f1b", {"pp": 4, "microbatches": 8, "vpp": 1}, "--vpp"),
        ("seq1f1b-interleaved", {"pp": 4, "microbatches": 8, "vpp": 1}, "--vpp"),
        ("v-min", {"pp": 4, "microbatches": 8, "vpp": 3}, "--vpp"),
        ("zb-h1", {"pp": 4, "microbatches": 8, "vpp": 2}, "--vpp"),
        ("slimpipe-interleaved", {"pp": 4, "microbatches": 8, "slices": 2}, "--slices"),
        ("zb-auto", {"pp": 4, "microbatches": 8, "memory_limit": 0.1}, "--memory-limit"),
        ("1f1b", {"pp": 4, "microbatches": 0}, "--microbatches"),
        ("v-zb", {"pp": 4, "microbatches": 4, "slices": 0}, "--slices"),
    ],
)
def test_impossible_requests_name_the_flag(name: str, kwargs: dict, flag: str) -> None:
    with pytest.raises(RequestError) as info:
        generate(name, **kwargs)
    assert info.value.flag == flag
    assert flag.lstrip("-").split("-")[0] in str(info.value).lower()


def test_fewer_microbatches_than_ranks_where_the_schedule_allows_it() -> None:
    for name in ("1f1b", "zb-h1", "zb-h2", "zb-auto", "v-min", "v-half", "v-zb", "interleaved-1f1b"):
        for m in (1, 2, 3):
            check(generate(name, 4, m))


# ---- hand-broken generated schedules are rejected with the right message -------------------


def edited(schedule: Schedule, rank: int, ops: list[Op]) -> Schedule:
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = ops
    return schedule.with_ranks(ranks)


def test_swapping_two_ops_is_caught() -> None:
    schedule = generate("zb-h1", 4, 8)
    ops = list(schedule.ranks[3])
    first_b = next(i for i, op in enumerate(ops) if op.kind == OpKind.B)
    own_f = ops.index(Op(OpKind.F, 3, ops[first_b].microbatch))
    ops[first_b], ops[own_f] = ops[own_f], ops[first_b]
    with pytest.raises(ScheduleError, match=r"needs F3:0, which rank 3 runs only later"):
        validate(edited(schedule, 3, ops))


def test_swapping_ops_across_ranks_deadlocks() -> None:
    schedule = generate("interleaved-1f1b", 2, 4)
    ops = list(schedule.ranks[0])
    first_b = next(i for i, op in enumerate(ops) if op.kind == OpKind.BW)
    ops.insert(0, ops.pop(first_b))  # a backward before anything has come back from rank 1
    with pytest.raises(ScheduleError, match="deadlock|runs only later"):
        validate(edited(schedule, 0, ops))


def test_dropping_an_op_is_caught() -> None:
    schedule = generate("v-zb", 4, 8)
    ops = [op for op in schedule.ranks[2] if op != Op(OpKind.W, 5, 3)]
    with pytest.raises(ScheduleError, match=r"missing op W5:3"):
        validate(edited(schedule, 2, ops))


def test_w_before_its_b_is_caught() -> None:
    schedule = generate("zb-h2", 4, 8, slices=2)
    ops = list(schedule.ranks[1])
    w = ops.index(Op(OpKind.W, 1, 2, 1))
    b = ops.index(Op(OpKind.B, 1, 2, 1))
    ops.insert(b, ops.pop(w))
    with pytest.raises(ScheduleError, match=r"W1:2\.1 at rank 1 position \d+ runs before its B1:2\.1"):
        validate(edited(schedule, 1, ops))


def test_op_on_the_wrong_rank_is_caught() -> None:
    schedule = generate("v-half", 4, 8)
    moved = Op(OpKind.F, 6, 0)  # stage 6 of a 4-rank V lives on rank 1
    ranks = [list(r) for r in schedule.ranks]
    ranks[1].remove(moved)
    ranks[2].insert(0, moved)
    with pytest.raises(ScheduleError, match="stage 6 belongs to rank 1 under vshape placement"):
        validate(schedule.with_ranks(ranks))


def test_mismatched_channel_order_is_caught() -> None:
    lowered = lower(generate("dualpipev", 4, 8))
    ops = list(lowered.ranks[0])
    sends = [i for i, op in enumerate(ops) if op.kind == OpKind.SEND_F]
    ops[sends[0]], ops[sends[1]] = ops[sends[1]], ops[sends[0]]
    with pytest.raises(ScheduleError, match="both ends must order the messages of a channel alike"):
        validate(edited(lowered, 0, ops))


# ---- unit costs (F = B = W = 1, comm 0, BW = 2): the papers' numbers ------------------------


def one_f_one_b_rate(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


def lower_bound(pp: int, m: int, chunks: int) -> float:
    """No schedule beats this: the last rank gets its first input after p-1 ops and then still
    has 3*chunks*m ops of work, so every rank idles p-1 on average."""
    return (pp - 1) / (3 * chunks * m + pp - 1)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 13), (8, 32), (8, 9)])
def test_1f1b_bubble_and_peak_are_exact(pp: int, m: int) -> None:
    result = simulate(generate("1f1b", pp, m))
    assert result.bubble_rate == pytest.approx(one_f_one_b_rate(pp, m))
    assert result.peak_memory_m[0] == pytest.approx(1.0 if m >= pp else m / pp)


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (4, 16), (6, 12), (8, 32)])
def test_zb_h1_idles_a_third_of_1f1b_at_its_memory(pp: int, m: int) -> None:
    one = simulate(generate("1f1b", pp, m))
    h1 = simulate(generate("zb-h1", pp, m))
    idle_1f1b = one.makespan - one.busy_per_rank[0]  # 3(p-1) on every rank
    idle_h1 = h1.makespan - h1.busy_per_rank[0]
    assert idle_1f1b == pytest.approx(3 * (pp - 1))
    assert idle_h1 == pytest.approx((pp - 1) * (1 + 1 - 1))  # (p-1)(F+B-W)
    assert max(h1.peak_memory_m) <= max(one.peak_memory_m) + 1e-9


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (4, 16), (6, 12), (8, 16), (8, 32)])
def test_zb_h2_has_no_bubble_but_the_fill(pp: int, m: int) -> None:
    result = simulate(generate("zb-h2", pp, m))
    assert result.bubble_rate == pytest.approx(lower_bound(pp, m, 1))
    assert rank_span_bubble(result) == pytest.approx(0.0, abs=1e-9)
    assert max(result.peak_memory_m) <= 2.0


@pytest.mark.parametrize(("pp", "m"), [(3, 6), (4, 8), (4, 16), (6, 24), (8, 16), (8, 32)])
def test_v_zb_has_no_bubble_but_the_fill_at_1f1b_memory(pp: int, m: int) -> None:
    result = simulate(generate("v-zb", pp, m))
    assert result.bubble_rate == pytest.approx(lower_bound(pp, m, 2), abs=1e-9)
    assert rank_span_bubble(result) == pytest.approx(0.0, abs=1e-9)
    assert max(result.peak_memory_m) <= 1.0 + 1e-9  # M (every accounting: tests/test_schedule_fidelity.py)


@pytest.mark.parametrize(("pp", "m"), [(3, 6), (4, 8), (4, 16), (6, 12), (8, 16), (8, 32)])
def test_v_half_halves_memory_and_bubble(pp: int, m: int) -> None:
    result = simulate(generate("v-half", pp, m))
    assert result.bubble_rate <= 0.6 * one_f_one_b_rate(pp, m)
    # the paper's (p+2)//2 microbatches, give or take one stage-unit (p = 3, 5, 7 overshoot by it)
    assert max(result.peak_memory_m) <= (pp + 2) // 2 / pp + 1 / (2 * pp) + 1e-9


@pytest.mark.parametrize(("pp", "m"), [(3, 6), (4, 8), (4, 16), (6, 12), (8, 16), (8, 32)])
def test_v_min_thirds_memory_at_two_thirds_the_bubble(pp: int, m: int) -> None:
    result = simulate(generate("v-min", pp, m))
    assert result.bubble_rate <= 0.75 * one_f_one_b_rate(pp, m)
    assert max(result.peak_memory_m) <= (pp + 4) // 3 / pp + 1e-9  # the paper's (p+4)//3 microbatches


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 9), (8, 16), (8, 32)])
def test_dualpipev_has_no_bubble_but_the_fill(pp: int, m: int) -> None:
    result = simulate(generate("dualpipev", pp, m))
    assert result.bubble_rate == pytest.approx(lower_bound(pp, m, 2), abs=1e-9)
    assert max(result.peak_memory_m) <= (pp + 1) / pp + 1e-9


@pytest.mark.parametrize(("pp", "m", "vpp"), [(4, 8, 2), (8, 32, 2), (4, 12, 3), (4, 6, 2), (8, 12, 2)])
def test_interleaved_beats_1f1b_at_about_1_plus_1_over_v_memory(pp: int, m: int, vpp: int) -> None:
    result = simulate(generate("interleaved-1f1b", pp, m, vpp=vpp))
    assert result.bubble_rate < one_f_one_b_rate(pp, m)
    assert result.peak_memory_m[0] <= 1 + 1 / vpp + 1e-9
    if m % pp == 0:
        assert result.bubble_rate <= 1.2 * one_f_one_b_rate(pp, m) / vpp + 0.05


@pytest.mark.parametrize(("pp", "m", "slices"), [(4, 8, 4), (8, 16, 8)])
def test_slicing_shrinks_bubble_and_memory(pp: int, m: int, slices: int) -> None:
    whole = simulate(generate("1f1b", pp, m))
    for name in ("seq1f1b", "slimpipe", "seq1f1b-interleaved", "slimpipe-interleaved", "zb-h1", "v-half"):
        result = simulate(generate(name, pp, m, slices=slices))
        assert result.bubble_rate < whole.bubble_rate / 2, name
        assert max(result.peak_memory_m) < max(whole.peak_memory_m), name


def test_seq1f1b_and_slimpipe_keep_their_in_flight_limits() -> None:
    pp, m, k = 4, 6, 4
    for name, limit in (("seq1f1b", lambda r: pp - r + k - 1), ("slimpipe", lambda r: k + 2 * (pp - 1 - r))):
        schedule = generate(name, pp, m, slices=k)
        for rank, ops in enumerate(schedule.ranks):
            held = peak = 0
            for op in ops:
                held += 1 if op.kind == OpKind.F else -1
                peak = max(peak, held)
            assert peak == limit(rank), (name, rank)


def test_zb_auto_uses_memory_to_cut_the_bubble() -> None:
    tight = simulate(generate("zb-auto", 4, 12, memory_limit=1.0))
    loose = simulate(generate("zb-auto", 4, 12, memory_limit=2.0))
    assert loose.bubble_rate <= tight.bubble_rate
    assert max(tight.peak_memory_m) <= 1.0 + 1e-9


def test_zb_auto_plans_with_the_given_costs() -> None:
    costs = Costs(forward=1.0, backward=2.0, weight=0.5, comm=0.2)
    from megatron_pp_ext.schedule.costs import UniformCosts

    model = UniformCosts(num_stages=4, forward=1.0, backward=2.0, weight=0.5, comm=0.2)
    auto = simulate(generate("zb-auto", 4, 12, costs=costs), model)
    h1 = simulate(generate("zb-h1", 4, 12), model)
    assert auto.makespan <= h1.makespan + 1e-9


# ---- large requests -------------------------------------------------------------------------
# How long generation takes is a benchmark (scripts/bench_schedule_core.py), not a test.


@pytest.mark.parametrize("name", NAMES)
def test_large_request_holds_every_unit_once(name: str) -> None:
    vpp = 2 if SCHEDULES[name].allowed_vpp is None or 2 in SCHEDULES[name].allowed_vpp else 1
    schedule = generate(name, 8, 64, vpp=vpp, slices=8)
    assert schedule.microbatches == 64
    units = {
        (stage, mb, j)
        for stage in range(schedule.num_stages)
        for mb in range(64)
        for j in range(schedule.slices)
    }
    kinds_of: dict[tuple[int, int, int], list[str]] = {}
    for _, _, op in schedule.all_ops():
        kinds_of.setdefault(op.unit, []).append(op.kind.value)
    assert set(kinds_of) == units, name
    for unit, kinds in kinds_of.items():
        # one forward, and one backward: fused, or split into B and a later W
        assert sorted(kinds) in (["BW", "F"], ["B", "F", "W"]), f"{name} {unit}: {kinds}"
    for rank, _, op in schedule.all_ops():
        assert schedule.placement.rank_of(op.stage) == rank, f"{name}: {op} on rank {rank}"
