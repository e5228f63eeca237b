"""The replay under NCCL's in-order completion (schedule/completion.py): hand-computed times, the
order of the three models, and a message order made at the run's costs costing nothing."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.schedule.completion import FREE, IN_ORDER, IN_ORDER_SYNC
from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.generators import SCHEDULES, generate
from megatron_pp_ext.schedule.ir import Schedule, format_op
from megatron_pp_ext.schedule.lowering import insert_offload, insert_p2p, lower
from megatron_pp_ext.schedule.nccl_check import check_nccl
from megatron_pp_ext.schedule.replay import replay
from megatron_pp_ext.schedule.validate import ScheduleError, validate
from megatron_pp_ext.schedule.vocab import add_vocab_passes, default_costs

# Rank 0 sends two forwards, then receives two gradients; rank 1 posts both receives first.
TWO_MESSAGES_IN_FLIGHT = """pp: 2
microbatches: 2
rank 0: F0:0 SEND_F0:0>1 F0:1 SEND_F0:1>1 RECV_B0:0<1 BW0:0 RECV_B0:1<1 BW0:1
rank 1: RECV_F1:0<0 RECV_F1:1<0 F1:0 F1:1 BW1:0 SEND_B1:0>0 BW1:1 SEND_B1:1>0
"""


def starts(schedule: Schedule, costs: UniformCosts, completion: str) -> tuple[float, dict[str, float]]:
    result = replay(schedule, costs, completion=completion)
    return result.makespan, {format_op(event.op): event.start for event in result.events}


def test_hand_computed_times_of_the_three_models() -> None:
    """F = B = W = 1 (BW = 2), every message 2. Free: F0:1's message leaves at 2 and arrives at 4.
    In order (a GPU): it waits on rank 0's queue until F0:0's completes at 3, so F1:1 starts at 5
    and everything after it one unit later (14). With the host computing (gloo emulating NCCL),
    rank 0 posts RECV_B0:1 only after BW0:0 ends at 12, so B1:1's gradient, sent at 10, completes
    at 14 and BW0:1 ends at 16."""
    schedule = Schedule.from_text(TWO_MESSAGES_IN_FLIGHT)
    validate(schedule)
    costs = UniformCosts(num_stages=2, comm=2.0)
    free, free_starts = starts(schedule, costs, FREE)
    gpu, gpu_starts = starts(schedule, costs, IN_ORDER)
    sync, sync_starts = starts(schedule, costs, IN_ORDER_SYNC)
    assert (free, gpu, sync) == (13.0, 14.0, 16.0)
    assert (free_starts["F1:1"], gpu_starts["F1:1"], sync_starts["F1:1"]) == (4.0, 5.0, 5.0)
    assert (gpu_starts["BW0:1"], sync_starts["BW0:1"]) == (12.0, 14.0)


def test_an_order_that_hangs_in_order_is_a_deadlock_of_the_replay() -> None:
    """Each rank's receive stands right before its consumer (``insert_p2p`` alone): rank 0 sends
    F0:1 and then receives B0:0, rank 1 the other way round. Free, the replay runs it; in order
    it names the launch queues' heads."""
    text = "pp: 2\nmicrobatches: 2\nrank 0: F0:0 F0:1 BW0:0 BW0:1\nrank 1: F1:0 BW1:0 F1:1 BW1:1"
    naive = insert_p2p(Schedule.from_text(text))
    replay(naive, completion=FREE)
    with pytest.raises(ScheduleError) as stuck:
        replay(naive, completion=IN_ORDER)
    assert "under in-order completion the launch queues wait at" in str(stuck.value), stuck.value
    assert "SEND_F0:1>1" in str(stuck.value) and "SEND_B1:0>0" in str(stuck.value), stuck.value


@pytest.mark.parametrize("pp", [2, 3])
def test_the_timed_replay_deadlocks_exactly_where_the_nccl_check_finds_a_hang(pp: int) -> None:
    """Two implementations of rule 3 agree: ``nccl_check`` (untimed, strict, warmed) and this
    replay. Every generator (m = p and 2p + 1, with and without vocabulary passes): the order
    ``insert_p2p`` alone gives hangs in both, the step's message order completes in both."""
    cases = 0
    for name, spec in SCHEDULES.items():
        slices = max(1, spec.min_slices(pp, spec.default_vpp))
        least = max(pp, spec.min_microbatches(pp, spec.default_vpp, slices))
        for microbatches in sorted({least, max(least, 2 * pp + 1)}):
            generated = generate(name, pp, microbatches, vpp=spec.default_vpp, slices=slices)
            for variant in ("none", "vocab-1"):
                resolved = add_vocab_passes(generated, variant) if variant != "none" else generated
                for order in (insert_p2p(resolved), lower(resolved)):
                    hang = check_nccl(order, strict=True, warmed=True) is not None
                    try:
                        replay(order, completion=IN_ORDER)
                        deadlock = False
                    except ScheduleError:
                        deadlock = True
                    assert deadlock == hang, (name, microbatches, variant, hang)
                    cases += 1
    assert cases >= 4 * len(SCHEDULES)


def test_an_unknown_completion_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of free, in-order, in-order-sync"):
        replay(lower(generate("1f1b", 2, 2)), completion="eager")


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_in_order_costs_nothing_at_the_costs_the_order_was_made_at(pp: int) -> None:
    """``message_order`` lists the messages in the order a replay at the run's costs sends
    them, so on a GPU (host ahead) in-order completion adds no wait at those costs, for every
    generator, with both vocabulary variants and with offload (latency 0). With latency, and with
    the host computing, each model is at least as slow as the one before: free <= in order <=
    in order with the host computing (times only grow with what they wait for)."""
    slower = 0
    for name, spec in SCHEDULES.items():
        slices = max(1, spec.min_slices(pp, spec.default_vpp))
        microbatches = max(pp, spec.min_microbatches(pp, spec.default_vpp, slices)) + 1
        generated = generate(name, pp, microbatches, vpp=spec.default_vpp, slices=slices)
        for variant in ("none", "vocab-1", "vocab-2"):
            if variant == "none":
                costs = UniformCosts(
                    num_stages=generated.num_stages,
                    num_slices=generated.slices,
                    chunks_per_rank=generated.vpp,
                    forward=1.0,
                    backward=2.0,
                    weight=1.0,
                )
                schedule = lower(generated, costs)
            else:
                with_vocab = add_vocab_passes(generated, variant)
                costs = default_costs(with_vocab, variant)
                schedule = lower(with_vocab, costs)
            for run in (schedule, insert_offload(schedule, lookahead=0)):
                free, gpu = (replay(run, costs, completion=c).makespan for c in (FREE, IN_ORDER))
                assert gpu == pytest.approx(free, rel=1e-12), (name, variant)
            costs.comm = 0.2
            free, gpu, sync = (
                replay(schedule, costs, completion=c).makespan for c in (FREE, IN_ORDER, IN_ORDER_SYNC)
            )
            assert free <= gpu + 1e-9 and gpu <= sync + 1e-9, (name, variant, free, gpu, sync)
            slower += sync > free + 1e-9
    assert slower > len(SCHEDULES), slower  # the models do differ once messages take time


def test_simulate_reports_what_in_order_completion_costs(capsys, tmp_path) -> None:
    """``simulate --comm-completion in-order`` replays under the rule and shows the makespan
    beside the one with sends that never wait (DualPipeV, p = 4, m = 8, costs 1,2,1, latency
    0.1: 40.4 against 37.8); JSON names the model; a saved schedule carries no result."""
    from megatron_pp_ext.cli import main

    base = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8"]
    base += ["--costs", "1,2,1", "--comm", "0.1"]
    saved = tmp_path / "saved.json"
    assert main([*base, "--comm-completion", "in-order", "--save", str(saved)]) == 0
    assert Schedule.from_json(saved.read_text()).meta == generate("dualpipev", 4, 8).meta
    out = capsys.readouterr().out
    header, _, row = out.splitlines()[:3]
    assert header.split()[-5:] == ["free", "sends:", "makespan", "in", "order"], header
    assert row.split()[3] == "40.4" and row.split()[-2:] == ["37.8", "+6.9%"], row
    assert main([*base, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["comm_completion"], data["makespan"]) == ("free", pytest.approx(37.8))


def test_plan_under_in_order_completion_is_never_faster(capsys) -> None:
    """``plan --comm-completion in-order`` replays every candidate under the rule: the title
    says so and the top plan's step is at least as long as with sends that never wait (measured
    2026-11-26: 53.515 -> 53.565 s, the same 1F1B plan)."""
    from megatron_pp_ext.cli import main

    args = ["plan", "--model", "llama3-8b", "--seq-length", "8192", "--gpus", "8", "--top", "1"]
    args += ["--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2", "--json"]
    steps = {}
    for completion in (FREE, IN_ORDER):
        assert main([*args, "--comm-completion", completion]) == 0
        (best,) = json.loads(capsys.readouterr().out)
        steps[completion] = best["step_time_s"]
    assert steps[FREE] < steps[IN_ORDER] < steps[FREE] * 1.01, steps
    assert main(args[:-1] + ["--comm-completion", IN_ORDER]) == 0
    assert "; messages complete in-order" in capsys.readouterr().out.splitlines()[0]


def test_simulate_names_the_flag_when_a_hand_written_order_hangs_in_order(tmp_path, capsys) -> None:
    """A schedule file whose order hangs under rule 3 runs free (its NCCL line says so); with
    ``--comm-completion in-order`` it is one line naming the flag and the launch queues' heads,
    exit 2, no traceback."""
    from megatron_pp_ext.cli import main

    text = "pp: 2\nmicrobatches: 2\nrank 0: F0:0 F0:1 BW0:0 BW0:1\nrank 1: F1:0 BW1:0 F1:1 BW1:1"
    path = tmp_path / "naive.txt"
    path.write_text(insert_p2p(Schedule.from_text(text)).to_text())
    assert main(["simulate", "--schedule-file", str(path)]) == 0
    assert "NCCL: in-order hangs" in capsys.readouterr().out
    assert main(["simulate", "--schedule-file", str(path), "--comm-completion", "in-order"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("megatron-pp-ext simulate: error: --comm-completion: in-order: deadlock"), line
    assert "launch queues wait at rank 0's SEND_F0:1>1, rank 1's SEND_B1:0>0" in line, line
