"""A schedule resolved at the run's own FLOP costs (schedule/run_costs.py): the vocabulary passes
placed and the messages ordered by what every rank computes alike from the model's shape. The
order still passes NCCL's rules, the simulator, the planner and the runtime's hook resolve a run
the same way, and the figures it recovers are the ones unit costs lost."""

from __future__ import annotations

import argparse
import math

import pytest

from megatron_pp_ext.commands import simulate as simulate_command
from megatron_pp_ext.megatron.hook import Installed, PipelineOptions, run_shape
from megatron_pp_ext.planner.step import build_schedule
from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import SCHEDULES, generate
from megatron_pp_ext.schedule.ir import Schedule
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.memory_model import Parallelism, stage_layers
from megatron_pp_ext.schedule.models import ModelShape, get_model, megatron_shape
from megatron_pp_ext.schedule.nccl_check import check_nccl
from megatron_pp_ext.schedule.replay import replay
from megatron_pp_ext.schedule.run_costs import RunShape, run_costs
from megatron_pp_ext.schedule.vocab import add_vocab_passes

LLAMA3 = RunShape(get_model("llama3-8b"), 4096)
# Gemma-2 9B (docs/vocab_parallel.md): a vocabulary of 256000 makes S and T far from unit cost
GEMMA2 = RunShape(ModelShape("gemma2-9b", 42, 3584, 16, 8, 256, 14336, 256000), 4096)


def resolved(name: str, pp: int, microbatches: int, variant: str, run: RunShape | None, **kwargs) -> Schedule:
    """The schedule as the hook resolves it: passes placed and messages ordered at ``run``'s
    costs, or at unit costs without one."""
    schedule = generate(name, pp, microbatches, **kwargs)
    costs = None if run is None else run_costs(run, schedule, variant)
    return lower(add_vocab_passes(schedule, variant, costs), costs)


def makespan(schedule: Schedule, run: RunShape, variant: str) -> float:
    """The FLOP model's step time (messages at 50 GB/s), as ``simulate --model`` reports it."""
    full = flop_costs_for(
        run.shape,
        schedule,
        seq_length=run.seq_length,
        layers_per_stage=stage_layers(run.shape.layers, schedule.num_stages),
        vocab_parallel=variant,
    )
    return replay(schedule, full).makespan


@pytest.mark.parametrize(
    ("name", "variant"), [("v-half", "vocab-2"), ("1f1b", "vocab-1"), ("zb-h1", "vocab-2")]
)
def test_run_costs_recover_what_unit_costs_lose(name: str, variant: str) -> None:
    """Gemma-2 9B at p = 8: placing S/T and ordering the messages at unit costs gives a longer
    step than at the run's costs (v-half vocab-2 6.171 -> 5.948 s, 1f1b vocab-1 6.414 -> 6.270 s,
    zb-h1 vocab-2 5.946 -> 5.798 s); both orders pass NCCL's rules."""
    unit = resolved(name, 8, 32, variant, None)
    own = resolved(name, 8, 32, variant, GEMMA2)
    assert own.ranks != unit.ranks
    for schedule in (unit, own):
        assert check_nccl(schedule, strict=True, warmed=True) is None
    assert makespan(own, GEMMA2, variant) < 0.985 * makespan(unit, GEMMA2, variant)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_generator_at_run_costs_passes_nccl(pp: int) -> None:
    """Any costs give one global order of the step's messages (message_order.py), so every
    generator resolved at the run's costs completes under rules 1-3: both vocabulary variants
    and none, whole sequences and the fewest slices each generator allows."""
    run = RunShape(get_model("llama3-8b"), 8 * 1680)  # cut evenly into 1..8, 10, 12, 14 or 16 slices
    checked = 0
    for name, spec in SCHEDULES.items():
        slices = max(1, spec.min_slices(pp, spec.default_vpp))
        microbatches = max(2 * pp + 1, spec.min_microbatches(pp, spec.default_vpp, slices))
        for variant in ("none", "vocab-1", "vocab-2"):
            schedule = resolved(name, pp, microbatches, variant, run, vpp=spec.default_vpp, slices=slices)
            assert check_nccl(schedule, strict=True, warmed=True) is None, (name, variant)
            checked += 1
    assert checked == 3 * len(SCHEDULES)


def test_the_order_does_not_depend_on_batch_or_tensor_parallelism() -> None:
    """Why RunShape is the shape and the sequence only: the micro-batch size scales every
    duration alike and TP/SP/CP change none (they shard bytes, and messages are instant), so the
    passes land and the messages line up the same with b = 4, TP4 with SP and CP2."""
    generated = generate("v-half", 4, 12)
    base = run_costs(LLAMA3, generated, "vocab-1")
    scaled = flop_costs_for(
        LLAMA3.shape,
        generated,
        seq_length=4096,
        micro_batch_size=4,
        parallel=Parallelism(tp=4, sp=True, cp=2),
        layers_per_stage=stage_layers(32, generated.num_stages),
        vocab_parallel="vocab-1",
        p2p_bandwidth=math.inf,
        p2p_latency=0.0,
    )
    spread = add_vocab_passes(generated, "vocab-1", base)
    assert add_vocab_passes(generated, "vocab-1", scaled).ranks == spread.ranks
    assert lower(spread, scaled).ranks == lower(spread, base).ranks
    assert lower(spread).ranks != lower(spread, base).ranks  # unit costs give another order


def simulate_args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["simulate", *[part for key, value in given.items() for part in (key, str(value))]]
    )
    simulate_command.resolve_model(args)
    return args


@pytest.mark.parametrize(("name", "variant"), [("v-half", "vocab-2"), ("1f1b", "none"), ("slimpipe", "none")])
def test_simulator_planner_and_hook_resolve_a_run_alike(name: str, variant: str) -> None:
    """What ``simulate --model`` replays, what ``plan`` replays and what the hook runs are one
    schedule for one run, so the figures describe the order the ranks follow."""
    pp, microbatches = 4, 8
    slices = 4 if name == "slimpipe" else 1
    options = PipelineOptions(schedule=name, vocab_parallel=variant, slices=slices)
    hook = Installed(options)
    hook.model = LLAMA3.shape
    ran = hook.schedule(pp, microbatches, run_shape(hook.model_shape(), 4096))
    assert ran.is_lowered
    assert ran.ranks == resolved(name, pp, microbatches, variant, LLAMA3, slices=slices).ranks

    args = simulate_args(
        **{"--model": "llama3-8b", "--schedule": name, "--pp": pp, "--microbatches": microbatches},
        **({"--pp-vocab-parallel": variant} if variant != "none" else {}),
        **({"--slices": slices} if slices > 1 else {}),
    )
    assert simulate_command.simulate_one(args, name).schedule.ranks == ran.ranks

    from megatron_pp_ext.planner.layout import Layout
    from megatron_pp_ext.planner.step import Candidate

    candidate = Candidate(Layout(tp=1, cp=1, pp=pp, dp=1), name, vpp=ran.vpp, slices=slices, vocab=variant)
    assert build_schedule(candidate, microbatches, run=LLAMA3).ranks == ran.ranks


def test_the_hook_reads_the_model_from_megatron_args() -> None:
    """Under pretrain_gpt.py the model's shape comes from Megatron-LM's args (the padded
    vocabulary included); without a shape or a sequence length the schedule runs at unit costs."""
    args = argparse.Namespace(
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=None,
        ffn_hidden_size=176,
        swiglu=True,
        padded_vocab_size=512,
    )
    hook = Installed(PipelineOptions(), args=args)
    assert hook.model_shape() == megatron_shape(args, 512)
    assert hook.model_shape().vocab == 512
    assert run_shape(None, 4096) is None and run_shape(hook.model_shape(), None) is None
    assert Installed(PipelineOptions()).model_shape() is None


def test_the_hook_splits_layers_as_megatron_does_under_uneven_end_stages() -> None:
    """Megatron-LM's --decoder-first/last-pipeline-num-layers: the hook's run costs take the
    layers of each stage as megatron-core builds them (the planner predicts that run with the
    same split), and a split megatron-core refuses leaves the even one."""
    args = argparse.Namespace(
        num_layers=10,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=14336,
        swiglu=True,
        padded_vocab_size=128256,
        pipeline_model_parallel_size=4,
        decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=3,
    )
    hook = Installed(PipelineOptions(vocab_parallel="vocab-1"), args=args)
    assert hook.stage_layers() == (1, 3, 3, 3)
    run = run_shape(hook.model_shape(), 4096, hook.stage_layers())
    assert run is not None and run.layers_per_stage == (1, 3, 3, 3)
    assert hook.schedule(4, 8, run).ranks == resolved("1f1b", 4, 8, "vocab-1", run).ranks
    refused = argparse.Namespace(**{**vars(args), "decoder_first_pipeline_num_layers": 2})  # 5 over 2
    assert Installed(PipelineOptions(), args=refused).stage_layers() is None


@pytest.mark.parametrize(
    ("split", "chunks", "layers"),
    [
        ({"pipeline_model_parallel_layout": "Et|tt|tt|tL"}, 2, (1, 2, 2, 1)),
        ({"decoder_last_pipeline_num_layers": 2}, 2, (2, 1, 2, 1)),
        (
            {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
            1,
            (3, 3),
        ),
    ],
)
def test_the_hook_takes_megatron_s_split_with_chunks_and_layouts(
    split: dict[str, object], chunks: int, layers: tuple[int, ...]
) -> None:
    """With several chunks per rank, a custom layout, or the embedding and loss counted as layers,
    the hook's run costs take megatron-core's split of every virtual stage (stage = chunk x p + rank)."""
    args = argparse.Namespace(
        num_layers=6,
        hidden_size=4096,
        num_attention_heads=32,
        padded_vocab_size=128256,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        **split,
    )
    name = "interleaved-1f1b" if chunks > 1 else "1f1b"
    hook = Installed(PipelineOptions(schedule=name, chunks=chunks, vocab_parallel="vocab-1"), args=args)
    assert hook.stage_layers() == layers
    run = run_shape(hook.model_shape(), 4096, hook.stage_layers())
    kwargs = {"vpp": chunks} if chunks > 1 else {}
    assert hook.schedule(2, 6, run).ranks == resolved(name, 2, 6, "vocab-1", run, **kwargs).ranks
