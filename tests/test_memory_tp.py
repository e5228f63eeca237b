"""Activation peaks measured under TP=2 (sequence parallelism off and on) against the simulator.

One launch of 4 gloo ranks (TP2 x PP2) runs 1F1B, ZB-H1 and V-Half on a tiny model built once
with SP off and once with SP on; a second launch of 2 ranks (TP1 x PP2) runs the same schedules
at TP=1. Each rank also measures per-stage probes (``stage_op_memory``: what one F keeps and what
its W still holds after B) under its own layout. Three kinds of check:

* **Absolute, calibrated.** The analytic bytes of ``FlopCosts`` (what ``simulate --model``
  uses) are 1.28-1.65x below what this model really saves: it is fp32 on CPU, whose SDPA math path
  keeps the attention probabilities (a x s per token; the model assumes flash attention), SiLU
  keeps its input beside the gate/up outputs, and RoPE and norms keep a few more small tensors. So,
  as in ``test_memory_vs_simulator.py``, the simulator is calibrated with the TP=2 probes and must
  predict every rank's peak to within a few p2p messages: the probes leave out the messages the
  runtime holds in flight (a posted receive, an output being sent, an incoming gradient), which is
  0 to 2 hidden-state messages in practice (s/(t if SP) x b x h x 4 bytes each). The band is
  [calibrated - 1 message, calibrated + 3 messages]; + 4 for V-Half, whose pipeline rank 1 (both
  legs of the V around its tip) was measured once in 7 runs holding 4 (its order since issue 25:
  the paper's, which keeps that rank busiest).
* **TP=2 over TP=1, analytic.** The ratio of the measured peaks must be the simulator's ratio for
  the model shape (SP off: only the inside-TP part halves, 0.654-0.667 here; SP on: all of it,
  0.5) within 7%. Measured deviations are -1.0 to +4.4% over several runs: the CPU extras and
  p2p messages that do not shard, plus one message of timing noise on either side. 7% still
  separates the two layouts' predictions (0.65 against 0.5, 30% apart) and catches the mismatch
  below (worst rank of each affected case +13 to +14%).
* **Per-stage probes, analytic.** The same ratio for one F's saved activation and one B's W share,
  stage by stage, without any pipeline timing in it (tolerance 7% again; F deviates by +0.8 to
  +3.1%, the W share without SP by -1.6 to +0.3%).

Under sequence parallelism the deferred W keeps only this rank's sequence share of its operands
(the inputs of the column-parallel linears and the output gradients of the row-parallel ones) and
gathers them in W, so the W share halves with everything else.

Run: ``pytest tests/test_memory_tp.py -s`` prints the numbers.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches

SCHEDULES = ["1f1b", "zb-h1", "v-half"]
IN_FLIGHT = {"v-half": 4}  # messages a rank may hold beyond the probes (the module docstring)
PP, TP, MICROBATCHES, LAYERS, SEQ, HIDDEN = 2, 2, 4, 4, 32, 32
LAYOUTS = [False, True]  # sequence parallel off, on
RATIO_TOLERANCE = 0.07


def make_model(sequence_parallel: bool):
    from megatron_pp_ext.megatron.model import ModelConfig

    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=64,
        seq_length=SEQ,
        extra={"sequence_parallel": True} if sequence_parallel else {},
    )


def measure_worker(rank: int, world: int, tp: int, layouts: list[bool], names: list[str]) -> dict:
    """Peak activation bytes of every (layout, schedule) on this rank, and this rank's per-stage
    probes (every rank of a TP group must run them: the stages run TP collectives)."""
    from megatron.core import parallel_state

    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.calibration import stage_op_memory
    from megatron_pp_ext.megatron.model import build_chunks, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    cpu_shim.install()
    init_parallel_state(PP, tp)
    pipeline = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    comm = PipeComm(pipeline, timeout_s=120)
    out: dict = {"pipeline_rank": comm.rank, "peaks": {}, "probes": {}}
    for sp in layouts:
        model = make_model(sp)
        batches = make_batches(model, MICROBATCHES)
        for name in names:
            schedule = generate(name, PP, MICROBATCHES)
            torch.manual_seed(0)
            chunks = build_chunks(model, schedule.placement, comm.rank)
            runtime = PipelineRuntime(
                chunks, comm, (model.seq_length, MICRO_BATCH, model.hidden_size), model.torch_dtype
            )
            result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
            out["peaks"][(sp, name)] = result.peak_activation_bytes
            if (sp, schedule.num_stages) not in out["probes"]:
                probes = stage_op_memory(model, schedule.num_stages, micro_batch_size=MICRO_BATCH)
                out["probes"][(sp, schedule.num_stages)] = [(p.forward, p.after_backward) for p in probes]
    comm.close()
    return out


def _schedule(name: str):
    from megatron_pp_ext.schedule.generators import generate

    return generate(name, PP, MICROBATCHES)


def flop_costs(num_stages: int, tp: int, sp: bool):
    """The cost model ``simulate --model`` builds, for the tiny model's shape and this layout."""
    from megatron_pp_ext.schedule.flops import FlopCosts
    from megatron_pp_ext.schedule.memory_model import Parallelism, stage_layers

    return FlopCosts(
        shape=make_model(sp).shape(),
        seq_length=SEQ,
        num_stages=num_stages,
        micro_batch_size=MICRO_BATCH,
        layers_per_stage=stage_layers(LAYERS, num_stages),
        parallel=Parallelism(tp=tp, sp=sp),
    )


@functools.cache
def analytic_peaks(name: str, tp: int, sp: bool) -> tuple[float, ...]:
    from megatron_pp_ext.schedule.simulate import simulate

    schedule = _schedule(name)
    return tuple(simulate(schedule, flop_costs(schedule.num_stages, tp, sp)).peak_memory_per_rank)


def calibrated_peaks(name: str, probes: list[tuple[int, int]]) -> list[float]:
    from megatron_pp_ext.schedule.costs import TableCosts, UniformCosts
    from megatron_pp_ext.schedule.simulate import simulate

    schedule = _schedule(name)
    costs = TableCosts(
        default=UniformCosts(num_stages=schedule.num_stages),
        activations={(stage,): float(forward) for stage, (forward, _) in enumerate(probes)},
        weight_shares={(stage,): float(share) for stage, (_, share) in enumerate(probes)},
    )
    return simulate(schedule, costs).peak_memory_per_rank


def message_bytes(sp: bool) -> int:
    """One hidden-state message between stages (fp32): this rank's share of the sequence."""
    return SEQ // (TP if sp else 1) * MICRO_BATCH * HIDDEN * 4


def _peaks(results: list[dict], sp: bool, name: str) -> list[tuple[int, int]]:
    """(pipeline rank, measured peak) of every rank; the TP ranks of one stage may differ by a
    message held in flight a little longer on one of them."""
    return [(result["pipeline_rank"], result["peaks"][(sp, name)]) for result in results]


def report(tp2: list[dict], tp1: list[dict]) -> str:
    """The measured peaks next to the simulator's, as a markdown table (docs/benchmarks.md)."""
    lines = [
        "| SP | schedule | pp rank | TP=1 measured | TP=2 measured | TP=2 calibrated | TP=2 analytic "
        "| TP2/TP1 measured | TP2/TP1 simulator |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sp in LAYOUTS:
        for name in SCHEDULES:
            calibrated = calibrated_peaks(name, tp2[0]["probes"][(sp, _schedule(name).num_stages)])
            analytic, base = analytic_peaks(name, TP, sp), analytic_peaks(name, 1, False)
            for rank in range(PP):
                one = [peak for r, peak in _peaks(tp1, False, name) if r == rank][0]
                two = [peak for r, peak in _peaks(tp2, sp, name) if r == rank]
                lines.append(
                    f"| {'on' if sp else 'off'} | {name} | {rank} | {one} | "
                    + ", ".join(str(peak) for peak in sorted(set(two)))
                    + f" | {calibrated[rank]:.0f} ({max(two) / calibrated[rank] - 1:+.1%}) | "
                    f"{analytic[rank]:.0f} ({max(two) / analytic[rank]:.2f}x) | "
                    + ", ".join(f"{peak / one:.3f}" for peak in sorted(set(two)))
                    + f" | {analytic[rank] / base[rank]:.3f} |"
                )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    tp2 = check_ok(run_ranks(measure_worker, TP * PP, TP, LAYOUTS, SCHEDULES, timeout=300))
    tp1 = check_ok(run_ranks(measure_worker, PP, 1, [False], SCHEDULES, timeout=300))
    print("\n" + report(tp2, tp1))
    return {"tp2": tp2, "tp1": tp1}


LAYOUT_IDS = {False: "sp-off", True: "sp-on"}


@pytest.mark.slow
@pytest.mark.parametrize("sp", LAYOUTS, ids=LAYOUT_IDS.get)
@pytest.mark.parametrize("name", SCHEDULES)
def test_tp2_peak_matches_calibrated_simulator(measured: dict, name: str, sp: bool) -> None:
    tp2 = measured["tp2"]
    want = calibrated_peaks(name, tp2[0]["probes"][(sp, _schedule(name).num_stages)])
    message = message_bytes(sp)
    in_flight = IN_FLIGHT.get(name, 3)
    for rank, (pp_rank, got) in enumerate(_peaks(tp2, sp, name)):
        excess = got - want[pp_rank]
        assert -message <= excess <= in_flight * message, (
            f"{name} SP={sp} rank {rank} (pp rank {pp_rank}): measured {got} B, calibrated simulator "
            f"{want[pp_rank]:.0f} B: {excess / message:+.1f} messages of {message} B "
            f"(allowed -1..+{in_flight})"
        )


RATIO_CASES = [
    pytest.param(
        name,
        sp,
        id=f"{name}-{LAYOUT_IDS[sp]}",
    )
    for sp in LAYOUTS
    for name in SCHEDULES
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "sp"), RATIO_CASES)
def test_tp2_over_tp1_peak_ratio_matches_simulator(measured: dict, name: str, sp: bool) -> None:
    one = dict(_peaks(measured["tp1"], False, name))
    predicted = [a / b for a, b in zip(analytic_peaks(name, TP, sp), analytic_peaks(name, 1, False))]
    for rank, (pp_rank, two) in enumerate(_peaks(measured["tp2"], sp, name)):
        ratio, want = two / one[pp_rank], predicted[pp_rank]
        assert abs(ratio / want - 1) <= RATIO_TOLERANCE, (
            f"{name} SP={sp} rank {rank} (pp rank {pp_rank}): TP=2 peak / TP=1 peak = "
            f"{two}/{one[pp_rank]} = {ratio:.3f}, simulator {want:.3f} ({ratio / want - 1:+.1%})"
        )


PROBE_CASES = [
    pytest.param(
        part,
        sp,
        id=f"{part}-{LAYOUT_IDS[sp]}",
    )
    for part in ("forward", "w-share")
    for sp in LAYOUTS
]


@pytest.mark.slow
@pytest.mark.parametrize(("part", "sp"), PROBE_CASES)
def test_probe_tp_ratio_matches_simulator(measured: dict, part: str, sp: bool) -> None:
    """Per stage, one F's saved bytes (or one B's W share) at TP=2 over TP=1, against the ratio of
    ``FlopCosts.activation`` (or ``weight_share``) for the two layouts: the TP/SP rule alone."""
    from megatron_pp_ext.schedule.ir import Op, OpKind

    index = 0 if part == "forward" else 1
    for stages in (2, 4):  # 1F1B/ZB-H1 and V-Half
        one = measured["tp1"][0]["probes"][(False, stages)]
        two = measured["tp2"][0]["probes"][(sp, stages)]
        base, costs = flop_costs(stages, 1, False), flop_costs(stages, TP, sp)
        for stage in range(stages):
            op = Op(OpKind.F if part == "forward" else OpKind.B, stage, 0)
            model = costs.activation if part == "forward" else costs.weight_share
            model_base = base.activation if part == "forward" else base.weight_share
            predicted = model(op) / model_base(op)
            ratio = two[stage][index] / one[stage][index]
            assert abs(ratio / predicted - 1) <= RATIO_TOLERANCE, (
                f"{part} of stage {stage}/{stages}, SP={sp}: TP=2 {two[stage][index]} B / TP=1 "
                f"{one[stage][index]} B = {ratio:.3f}, simulator {predicted:.3f}"
            )
