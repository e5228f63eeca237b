"""SlimPipe's attention workload redistribution in the simulator: heavy ranks hand part of their
attention to light partners at each lock-step slot, total work stays the same, and the bubble of
uniform-slice schedules drops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.redistribute import attention_time, lockstep_slots, redistribute
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
    command = [sys.executable, "-m", "megatron_pp_ext", "simulate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_simulate_flag_reports_the_bubble_with_and_without() -> None:
    base = ["--schedule", "slimpipe", "--pp", "4", "--microbatches", "8", "--slices", "8"]
    done = simulate_cli(
        *base, "--model", "llama-7b", "--seq-length", "65536", "--pp-attn-redistribution", "0.1"
    )
    assert done.returncode == 0, done.stderr
    assert "attention redistribution (cap 0.1): bubble 0.095 without -> 0.078 with" in done.stdout
    refused = simulate_cli(*base, "--pp-attn-redistribution", "0.1")
    assert refused.returncode == 2 and "--pp-attn-redistribution" in refused.stderr
