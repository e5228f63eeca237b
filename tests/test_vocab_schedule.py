"""Vocabulary parallelism in the schedule core: the S/T ops and collectives in the IR, the pass that
places them into any generator's schedule, the validator's rules for them, the simulator's time and
memory, the pictures and ``simulate --pp-vocab-parallel``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule import plot
from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import SCHEDULES, generate
from megatron_pp_ext.schedule.ir import COLLECTIVE_KINDS, Op, OpKind, Schedule, load, parse_op, save
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.memory_model import rank_params, stage_layers
from megatron_pp_ext.schedule.models import get_model
from megatron_pp_ext.schedule.simulate import simulate
from megatron_pp_ext.schedule.validate import ScheduleError, validate
from megatron_pp_ext.schedule.vocab import (
    CHANNELS,
    VocabError,
    add_vocab_passes,
    delay_backwards,
    vocab_rank_params,
)

VARIANTS = ("vocab-1", "vocab-2")
SLICES = {"seq1f1b": 2, "seq1f1b-interleaved": 2, "slimpipe": 4, "slimpipe-interleaved": 4}


def llama3(schedule: Schedule, variant: str = "none"):
    return flop_costs_for(
        "llama3-8b",
        schedule,
        seq_length=4096,
        layers_per_stage=stage_layers(32, schedule.num_stages),
        vocab_parallel=variant,
    )


# ---- IR ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [OpKind.S, OpKind.T, *sorted(COLLECTIVE_KINDS, key=lambda k: k.value)])
def test_new_ops_round_trip_as_text(kind: OpKind) -> None:
    for op in (Op(kind, 7, 3), Op(kind, 7, 3, 2)):
        assert parse_op(str(op)) == op
        assert op.is_vocab and op.is_collective == (kind in COLLECTIVE_KINDS)
        assert not op.is_compute and not op.is_comm  # existing kinds keep their meaning
    assert str(Op(OpKind.S, 7, 3, 1)) == "S7:3.1"
    assert parse_op("BCAST_X3:0").kind == OpKind.BCAST_X and parse_op("BW3:0").kind == OpKind.BW


@pytest.mark.parametrize("suffix", [".json", ".txt"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_schedule_with_vocab_passes_round_trips(tmp_path: Path, suffix: str, variant: str) -> None:
    schedule = add_vocab_passes(generate("1f1b", 3, 4, slices=2), variant)
    assert schedule.vocab_parallel == variant
    path = str(tmp_path / f"s{suffix}")
    save(schedule, path)
    loaded = load(path)
    assert loaded.ranks == schedule.ranks and loaded.vocab_parallel == variant
    validate(loaded)


# ---- the pass on every generator ----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_generator_gets_valid_vocab_passes(name: str, variant: str) -> None:
    base = generate(name, 4, 8, slices=SLICES.get(name, 1))
    schedule = add_vocab_passes(base, variant)
    validate(schedule)
    validate(lower(schedule))
    units = base.microbatches * base.slices
    per_unit = 5 if variant == "vocab-1" else 4  # S, T, BCAST_X, REDUCE_S (, REDUCE_T)
    for rank, ops in enumerate(schedule.ranks):
        kinds = [op.kind for op in ops]
        assert kinds.count(OpKind.S) == kinds.count(OpKind.T) == units
        assert sum(kinds.count(k) for k in (OpKind.BCAST_X, OpKind.REDUCE_S, OpKind.REDUCE_T)) == units * (
            per_unit - 2
        )
        # the generator's own ops are all still there, on their ranks
        assert sorted(map(str, (op for op in ops if op.is_compute))) == sorted(map(str, base.ranks[rank]))
    result = simulate(schedule)
    assert result.makespan > 0 and len(result.collectives) > 0


def test_every_rank_issues_each_channel_in_the_same_order() -> None:
    schedule = add_vocab_passes(
        generate("v-half", 4, 8), "vocab-1", llama3(generate("v-half", 4, 8), "vocab-1")
    )
    for channel in ("x", "out", "emb"):
        orders = [
            [str(op) for op in ops if op.is_collective and CHANNELS[op.kind] == channel]
            for ops in schedule.ranks
        ]
        assert all(order == orders[0] for order in orders) and orders[0]


def test_delay_backwards_gives_1f1b_more_warmup() -> None:
    ranks = generate("1f1b", 4, 8).ranks
    for shift in (1, 2):
        for rank, ops in enumerate(ranks):
            delayed = delay_backwards(ops, shift)
            first_backward = next(i for i, op in enumerate(delayed) if op.kind == OpKind.BW)
            assert first_backward == min(4 - rank + shift, 8)
            assert sorted(map(str, delayed)) == sorted(map(str, ops))


def test_pass_refuses_lowered_or_mismatched_input() -> None:
    base = generate("1f1b", 2, 2)
    with pytest.raises(VocabError, match="before p2p lowering"):
        add_vocab_passes(lower(base), "vocab-1")
    with pytest.raises(VocabError, match="charged for the output layer twice"):
        add_vocab_passes(base, "vocab-1", llama3(base, "vocab-2"))
    with pytest.raises(VocabError, match="already has vocabulary passes"):
        add_vocab_passes(add_vocab_passes(base, "vocab-2"), "vocab-2")
    assert add_vocab_passes(base, "none") is base


# ---- validator ----------------------------------------------------------------------------------


def _swap(ops: list[Op], first: Op, second: Op) -> None:
    i, j = ops.index(first), ops.index(second)
    ops[i], ops[j] = ops[j], ops[i]


def test_validator_rejects_a_t_before_its_s() -> None:
    schedule = add_vocab_passes(generate("1f1b", 2, 3), "vocab-2")
    _swap(schedule.ranks[0], Op(OpKind.S, 1, 1), Op(OpKind.T, 1, 1))
    with pytest.raises(ScheduleError, match=r"T1:1 at rank 0 position \d+ runs before S1:1"):
        validate(schedule)


def test_validator_rejects_mismatched_collective_order() -> None:
    schedule = add_vocab_passes(generate("1f1b", 2, 3), "vocab-1")
    # Both token-id broadcasts come before their lookups, so each rank alone is fine.
    _swap(schedule.ranks[1], Op(OpKind.BCAST_IDS, 0, 0), Op(OpKind.BCAST_IDS, 0, 1))
    with pytest.raises(
        ScheduleError,
        match=r"collective order differs in channel 'emb': collective 0 is BCAST_IDS0:0 on rank 0 "
        r"but BCAST_IDS0:1 on rank 1",
    ):
        validate(schedule)


def test_validator_rejects_missing_passes_and_backward_before_its_gradient() -> None:
    schedule = add_vocab_passes(generate("1f1b", 2, 2), "vocab-1")
    schedule.ranks[0] = [op for op in schedule.ranks[0] if op != Op(OpKind.S, 1, 1)]
    with pytest.raises(ScheduleError, match="rank 0 has no S1:1"):
        validate(schedule)
    schedule = add_vocab_passes(generate("1f1b", 2, 2), "vocab-1")
    loss = schedule.ranks[1]
    loss.remove(Op(OpKind.BW, 1, 0))
    loss.insert(loss.index(Op(OpKind.REDUCE_T, 1, 0)), Op(OpKind.BW, 1, 0))
    with pytest.raises(ScheduleError, match=r"BW1:0 at rank 1 position \d+ runs before REDUCE_T1:0"):
        validate(schedule)


def test_validator_catches_a_collective_deadlock_across_ranks() -> None:
    # Every rank's own order is fine, but rank 0 posts the broadcast for its S only after its
    # backward, which waits for the loss rank's backward, which waits for every rank's S.
    text = (
        "pp: 2\nmicrobatches: 1\n"
        "rank 0: BCAST_IDS0:0 REDUCE_EMB0:0 F0:0 BW0:0 BCAST_DEMB0:0 BCAST_X1:0 S1:0 REDUCE_S1:0 T1:0\n"
        "rank 1: BCAST_IDS0:0 REDUCE_EMB0:0 F1:0 BCAST_X1:0 S1:0 REDUCE_S1:0 T1:0 BW1:0 BCAST_DEMB0:0\n"
    )
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: rank 0 waits at BW0:0 \(position 3\) for B/BW1:0 on rank 1; "
        r"rank 1 waits at S1:0 \(position 4\) for BCAST_X1:0 on every rank",
    ):
        validate(Schedule.from_text(text))


# ---- simulator ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize(("variant", "extra"), [("vocab-1", 2), ("vocab-2", 1)])
def test_1f1b_busiest_rank_holds_the_papers_microbatches(pp: int, variant: str, extra: int) -> None:
    """The paper: Vocab-1 keeps p+2 microbatches of activation on 1F1B's busiest rank, Vocab-2
    p+1. One microbatch on one rank is 1/p M, so rank 0 peaks at (p+extra)/p M."""
    base = generate("1f1b", pp, 4 * pp)
    result = simulate(add_vocab_passes(base, variant), UniformCosts(num_stages=pp))
    assert max(result.peak_memory_m) == pytest.approx((pp + extra) / pp)
    assert result.peak_memory_m[0] == pytest.approx((pp + extra) / pp)
    assert max(simulate(base).peak_memory_m) == pytest.approx(1.0)


@pytest.mark.parametrize(("variant", "extra"), [("vocab-1", 2), ("vocab-2", 1)])
def test_flop_model_busiest_rank_in_microbatches(variant: str, extra: int) -> None:
    """Llama-3 8B, p=8: rank 0 holds p+extra microbatches of its 4 layers, plus at most two
    logits shards (an S waiting for its T, and the next S)."""
    base = generate("1f1b", 8, 16)
    costs = llama3(base, variant)
    result = simulate(add_vocab_passes(base, variant, costs), costs)
    unit = costs.activation(Op(OpKind.F, 0, 0))
    shard = costs.vocab_activation(Op(OpKind.S, 7, 0))
    assert (8 + extra) * unit <= result.peak_memory_per_rank[0] <= (8 + extra) * unit + 2 * shard
    assert shard < 0.05 * unit * 8  # a logits shard is small next to the stage activations


@pytest.mark.parametrize("microbatches", [16, 32])
@pytest.mark.parametrize("variant", VARIANTS)
def test_vocab_parallel_beats_the_heavy_last_stage(variant: str, microbatches: int) -> None:
    """Llama-3 8B (vocabulary 128256) at p=8: the output layer alone is 2.2 layers' work on the
    last stage; spread over all ranks the makespan drops and busy time evens out."""
    base = generate("1f1b", 8, microbatches)
    without = simulate(base, llama3(base))
    costs = llama3(base, variant)
    with_vocab = simulate(add_vocab_passes(base, variant, costs), costs)
    assert with_vocab.makespan < 0.8 * without.makespan
    assert without.busy_max_over_min > 1.5
    assert with_vocab.busy_max_over_min == pytest.approx(1.0, abs=0.01)


def test_flop_model_moves_the_output_layer_onto_every_rank() -> None:
    base = generate("1f1b", 8, 8)
    plain, spread = llama3(base), llama3(base, "vocab-1")
    last = Op(OpKind.F, 7, 0)
    head = 2 * 4096 * 4096 * 128256  # 2 s h V
    for kind in (OpKind.F, OpKind.B, OpKind.W):
        assert plain.flops(Op(kind, 7, 0)) - spread.flops(Op(kind, 7, 0)) == pytest.approx(head)
        assert plain.flops(Op(kind, 0, 0)) == spread.flops(Op(kind, 0, 0))
    per_rank = spread.flops(Op(OpKind.S, 7, 0)) + spread.flops(Op(OpKind.T, 7, 0))
    assert 8 * per_rank == pytest.approx(3 * head)
    v2 = llama3(base, "vocab-2")
    assert v2.flops(Op(OpKind.S, 7, 0)) == pytest.approx(2 * spread.flops(Op(OpKind.S, 7, 0)))
    assert spread.activation(last) < plain.activation(last)  # the logits left the last stage


def test_collectives_synchronise_every_rank() -> None:
    """A collective completes only once the last rank issued it: with a slow rank 1, rank 0's T
    waits for rank 1's S."""
    text = (
        "pp: 2\nmicrobatches: 1\n"
        "rank 0: BCAST_X1:0 BCAST_IDS0:0 REDUCE_EMB0:0 F0:0 S1:0 REDUCE_S1:0 T1:0 BW0:0 BCAST_DEMB0:0\n"
        "rank 1: BCAST_IDS0:0 REDUCE_EMB0:0 F1:0 BCAST_X1:0 S1:0 REDUCE_S1:0 T1:0 BW1:0 BCAST_DEMB0:0\n"
    )
    schedule = Schedule.from_text(text)
    validate(schedule)
    costs = UniformCosts(num_stages=2, vocab_forward=1.0, vocab_backward=1.0, collective=0.5)
    result = simulate(schedule, costs)
    starts = {(e.rank, str(e.op)): e.start for e in result.events}
    # F0 waits for the embedding reduce (0.5 after both issued the ids broadcast at 0.5): 1.0..2.0
    assert starts[(0, "F0:0")] == pytest.approx(1.0)
    assert starts[(1, "F1:0")] == pytest.approx(2.0)
    # BCAST_X issued by rank 1 at 3.0, done 3.5; both S run 3.5..4.5; REDUCE_S done 5.0
    assert starts[(0, "S1:0")] == starts[(1, "S1:0")] == pytest.approx(3.5)
    assert starts[(0, "T1:0")] == starts[(1, "T1:0")] == pytest.approx(5.0)
    assert starts[(1, "BW1:0")] == pytest.approx(6.0)  # vocab-2: the gradient came with REDUCE_S
    assert result.busy_per_rank == pytest.approx([1 + 1 + 1 + 2, 1 + 1 + 1 + 2])


def test_vocab_activation_is_held_from_s_to_t() -> None:
    schedule = Schedule.from_text(
        "pp: 1\nmicrobatches: 1\n"
        "rank 0: BCAST_IDS0:0 REDUCE_EMB0:0 F0:0 BCAST_X0:0 S0:0 REDUCE_S0:0 T0:0 BW0:0 BCAST_DEMB0:0\n"
    )
    costs = UniformCosts(num_stages=1, vocab_forward=1, vocab_backward=1, vocab_memory=0.25)
    result = simulate(schedule, costs)
    assert [value for _, value in result.memory_curves[0]] == pytest.approx([0, 1, 1.25, 1.0, 0])


def test_vocab_static_memory_is_balanced() -> None:
    shape = get_model("llama3-8b")
    base = generate("1f1b", 8, 8)
    layers = stage_layers(32, 8)
    plain = rank_params(shape, base.placement, layers)
    spread = vocab_rank_params(shape, base.placement, layers)
    assert max(plain) / min(plain) > 1.5
    assert max(spread) / min(spread) == pytest.approx(1.0, abs=1e-4)  # the final norm on the last rank
    assert sum(spread) == pytest.approx(sum(plain), rel=1e-3)  # only the padding differs


# ---- pictures and the command line --------------------------------------------------------------


def test_picture_and_trace_show_s_and_t(tmp_path: Path) -> None:
    base = generate("1f1b", 4, 6)
    costs = llama3(base, "vocab-1")
    result = simulate(add_vocab_passes(base, "vocab-1", costs), costs)
    path = tmp_path / "vocab.png"
    plot.plot_timeline(result, str(path), time_unit="s")
    assert path.stat().st_size > 1000
    assert {OpKind.S, OpKind.T} <= set(plot.KIND_COLOURS) and OpKind.S in plot.LEGEND_NAMES
    trace = plot.trace_events(result)
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert "S 0 s3" in names and "T 5 s3" in names
    assert any(e.get("cat") == "REDUCE_T" and e["tid"] == 3 for e in trace["traceEvents"])
    assert "vocab-1" in plot._title(result)


def test_simulate_command_compares_with_and_without(capsys) -> None:
    args = ["simulate", "--pp", "8", "--microbatches", "16", "--model", "llama3-8b", "--seq-length", "4096"]
    assert main([*args, "--pp-vocab-parallel", "vocab-2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vocab_parallel"] == "vocab-2"
    plain = data["without_vocab_parallel"]
    assert plain["vocab_parallel"] == "none" and data["makespan"] < plain["makespan"]
    assert data["busy_max_over_min"] < plain["busy_max_over_min"]
    assert data["memory_max_over_min"] < plain["memory_max_over_min"]
    assert len(data["memory_parts_bytes"]) == 8 and "memory_parts_bytes" in plain
    assert main([*args, "--pp-vocab-parallel", "vocab-1"]) == 0
    out = capsys.readouterr().out
    assert "no vocab: makespan" in out and "vocabulary parallelism vocab-1: makespan" in out


def test_simulate_command_uniform_costs_and_errors(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "v.txt"
    args = ["simulate", "--pp", "4", "--microbatches", "8", "--pp-vocab-parallel", "vocab-1"]
    assert main([*args, "--vocab-costs", "0.2,0.4", "--save", str(saved), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["makespan"] < data["without_vocab_parallel"]["makespan"]
    assert load(str(saved)).vocab_parallel == "vocab-1"
    assert main(["simulate", "--schedule-file", str(saved), "--json"]) == 0  # replays the file's passes
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["vocab_parallel"] == "vocab-1"
    assert main([*args, "--vocab-costs", "1"]) == 2
    assert main(["simulate", "--schedule-file", str(saved), "--pp-vocab-parallel", "vocab-2"]) == 2
    err = capsys.readouterr().err
    assert "--vocab-costs" in err and "already has vocabulary passes" in err


def test_simulate_command_composes_with_offload_and_redistribution(capsys) -> None:
    offload = ["simulate", "--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "8"]
    assert main([*offload, "--pp-offload", "selective", "--pp-vocab-parallel", "vocab-1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "without_offload" in data and "without_offload" in data["without_vocab_parallel"]
    assert max(data["peak_memory_m"]) < max(data["without_offload"]["peak_memory_m"])
    sliced = ["simulate", "--schedule", "slimpipe", "--pp", "4", "--microbatches", "4", "--slices", "4"]
    sliced += ["--model", "llama-7b", "--seq-length", "16384", "--pp-attn-redistribution", "0.25"]
    assert main([*sliced, "--pp-vocab-parallel", "vocab-2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # pairs come from the generator's order: S and T carry no attention to trade
    assert data["makespan"] < data["without_vocab_parallel"]["makespan"]
