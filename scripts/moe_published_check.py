"""Check the planner's first MoE cost model against the published MoE runs of
docs/moe_published_runs.md (issue #47): measure, don't enable.

    python scripts/moe_published_check.py

For each run whose model ``ModelShape`` can express, the run's layout is pinned (TP, CP, PP, DP,
EP, ETP, VPP, micro-batch, global batch) and evaluated with the planner's own pinned-run path:
``predict.pinned_candidate`` builds the candidate from ``Pins`` and ``step.evaluate`` replays it
(every microbatch when ``predict.PREDICT_FULL_UNITS`` allows, memory reported not checked), with
``costs.PlanCosts`` timing the MoE layers and the expert all-to-all under the run's dispatcher
(``Run.dispatcher``: "flex" for DeepEP / HybridEP, "alltoall"), passed by swapping
``step.PlanCosts`` for the call (``dispatcher`` below; ``Candidate`` has no dispatcher field).

THE MoE REFUSAL IS BYPASSED HERE ONLY. ``plan`` refuses MoE models in ``planner/model.py``
(``resolve``) and ``planner/megatron_args.py`` (``read_args``); this script never calls those, it
builds ``ModelShape`` directly. ``Pins``/``Layout`` from ``Pins.layouts`` have no EP, so the
candidate's layout is replaced by the same layout with the run's EP and ETP (``Layout`` checks
megatron-core's folding rule). Nothing in the planner is changed.

Published step time: GBS x seq x F_tok / (TFLOP/s/GPU x 1e12 x GPUs) with F_tok from the file's
table (Megatron's count), or the published seconds per step where a source gives them.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial

from megatron_pp_ext.planner import step
from megatron_pp_ext.planner.costs import PlanCosts
from megatron_pp_ext.planner.devices import get_profile
from megatron_pp_ext.planner.pins import Pins
from megatron_pp_ext.planner.predict import PREDICT_FULL_UNITS, pinned_candidate
from megatron_pp_ext.planner.step import PlanResult, Problem, evaluate, pipeline_of
from megatron_pp_ext.schedule.ir import Op, OpKind
from megatron_pp_ext.schedule.models import ModelShape

SEQ = 4096

# ---- model shapes (docs/moe_published_runs.md sections 1-5) ------------------------------------

QWEN3_30B = ModelShape(
    "qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, experts=128, topk=8, expert_ffn=768
)
QWEN3_235B = ModelShape(
    "qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 151936, experts=128, topk=8, expert_ffn=1536
)
MIXTRAL_8X22B = ModelShape(
    "mixtral-8x22b", 56, 6144, 48, 8, 128, 16384, 32768, experts=8, topk=2, expert_ffn=16384
)
# DeepSeek-V3: MLA is not modelled. Approximated as GQA with 128 query heads of dim 128 and 2 KV
# groups (the fewest TP2 divides): Q/K/V/O projections 7168 x 128 x 128 x (2 + 2 x 2/128) = 238M
# parameters per layer against MLA's 187M (q_down/q_up/kv_down/kv_up/o, +27%); the s^2 core at
# head dim 128 against MLA's 192 (QK^T) / 128 (PV), -17% on QK^T. The MTP layer (depth 1) is one
# more MoE layer at the end (62 layers: 3 dense + 59 MoE); its norms, 2h^2 projection and its own
# logits (6hV per token) are not counted.
DEEPSEEK_V3_MTP = ModelShape(
    "deepseek-v3 (MLA as GQA 128x128/2, MTP as a 62nd layer)",
    62,
    7168,
    128,
    2,
    128,
    18432,
    129280,
    experts=256,
    topk=8,
    expert_ffn=2048,
    shared_expert_ffn=2048,
    moe_layer_freq=tuple([0] * 3 + [1] * 59),
)


@dataclass
class Run:
    key: str
    what: str
    shape: ModelShape
    gpus: int
    tp: int
    pp: int
    ep: int
    etp: int
    vpp: int
    global_batch: int
    published: str
    published_step: float
    derivation: str
    cp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    stage_layers: tuple[int, ...] | None = None
    dispatcher: str = "flex"  # PlanCosts' dispatcher: "flex" (DeepEP / HybridEP) or "alltoall"
    assumptions: list[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)


def tf_step(global_batch: int, f_tok: float, tflops: float, gpus: int) -> float:
    return global_batch * SEQ * f_tok / (tflops * 1e12 * gpus)


F_Q30, F_Q235, F_DS, F_MIX = 2.3006e10, 1.4803e11, 2.5999e11, 2.4220e11
FP8 = "run used FP8 GEMMs; predicted in BF16 (the planner has no FP8), so the prediction should be slower"
NO_EP_OVERLAP = (
    "run overlapped the EP all-to-all with compute (--overlap-moe-expert-parallel-comm); the "
    "planner's interleaved/no-PP schedules have no overlapped pairs, so the all-to-all is exposed"
)
FORCED = "forced-balance routing, as the cost model assumes"
DS_RECOMP = (
    "run recomputed mla_up_proj and mlp (selective); predicted with no recomputation (the planner's "
    "'selective' is attention only), so the prediction misses the MLP rerun (about +1/3 of MLP forward)"
)
DS_SPLIT = "Megatron layout Et|(tt|)*30mL as stage layers 1, 2 x 30, 1 (the MTP layer on the last stage)"
Q235_SPLIT = "embedding and loss accounted in the split: stage layers 2, 3 x 30, 2"


def runs() -> list[Run]:
    return [
        Run(
            "2a",
            "DeepSeek-V3, Bridge 25.09, FP8",
            DEEPSEEK_V3_MTP,
            1024,
            2,
            8,
            64,
            1,
            4,
            8192,
            "1297 tok/s/GPU",
            8192 * SEQ / (1297 * 1024),
            "GBS x seq / (tok/s/GPU x GPUs)",
            stage_layers=(1, *[2] * 30, 1),
            assumptions=[FP8, NO_EP_OVERLAP, DS_RECOMP, DS_SPLIT, "DeepEP dispatcher", FORCED],
        ),
        Run(
            "2b",
            "DeepSeek-V3, Bridge card, BF16",
            DEEPSEEK_V3_MTP,
            1024,
            2,
            8,
            64,
            1,
            4,
            16384,
            "61.756 s/step",
            61.756,
            "published s/step",
            stage_layers=(1, *[2] * 30, 1),
            assumptions=[
                "EP overlap off (as modelled)",
                DS_RECOMP,
                DS_SPLIT,
                "HybridEP dispatcher",
                "shared-expert overlap on (not modelled)",
                FORCED,
            ],
        ),
        Run(
            "3a",
            "Qwen3-235B-A22B, Bridge 26.04.01, FP8",
            QWEN3_235B,
            256,
            2,
            8,
            32,
            1,
            4,
            8192,
            "253 TFLOP/s/GPU",
            tf_step(8192, F_Q235, 253, 256),
            "GBS x seq x F_tok / (TF x GPUs)",
            stage_layers=(2, *[3] * 30, 2),
            dispatcher="alltoall",
            assumptions=[FP8, NO_EP_OVERLAP, Q235_SPLIT, "alltoall dispatcher", FORCED],
        ),
        Run(
            "3b",
            "Qwen3-235B-A22B, Model Zoo, BF16, no EP overlap",
            QWEN3_235B,
            256,
            2,
            8,
            32,
            1,
            4,
            2048,
            "19.7 s/step",
            19.7,
            "published s/step",
            stage_layers=(2, *[3] * 30, 2),
            assumptions=[
                "EP overlap off (as modelled)",
                Q235_SPLIT,
                "recompute moe_act+layernorm not modelled (cheap)",
                "DeepEP dispatcher",
                FORCED,
            ],
        ),
        Run(
            "3b+",
            "Qwen3-235B-A22B, Model Zoo, BF16, combined-1F1B EP overlap",
            QWEN3_235B,
            256,
            2,
            8,
            32,
            1,
            4,
            2048,
            "17.6 s/step",
            17.6,
            "published s/step",
            stage_layers=(2, *[3] * 30, 2),
            assumptions=[NO_EP_OVERLAP, Q235_SPLIT, "same prediction as 3b", FORCED],
        ),
        Run(
            "4a",
            "Qwen3-30B-A3B, Bridge card, BF16",
            QWEN3_30B,
            16,
            1,
            1,
            16,
            1,
            1,
            1024,
            "20.147 s/step",
            20.147,
            "published s/step",
            assumptions=[
                NO_EP_OVERLAP,
                "EP16 over 2 nodes of 8: all-to-all split NVLink / IB",
                "HybridEP, CUDA graphs",
                FORCED,
            ],
        ),
        Run(
            "4b",
            "Qwen3-30B-A3B, Bridge 26.06, FP8",
            QWEN3_30B,
            16,
            1,
            1,
            16,
            1,
            1,
            1024,
            "8826 tok/s/GPU",
            1024 * SEQ / (8826 * 16),
            "GBS x seq / (tok/s/GPU x GPUs)",
            assumptions=[
                FP8,
                "EP overlap off (as modelled)",
                "EP16 over 2 nodes of 8: all-to-all split NVLink / IB",
                "HybridEP dispatcher",
                FORCED,
            ],
        ),
        Run(
            "5",
            "Mixtral 8x22B, Model Zoo comment, BF16",
            MIXTRAL_8X22B,
            128,
            2,
            8,
            8,
            1,
            7,
            256,
            "~445 TFLOP/s/GPU",
            tf_step(256, F_MIX, 445, 128),
            "GBS x seq x F_tok / (TF x GPUs)",
            dispatcher="alltoall",
            assumptions=[
                "EP overlap off (as modelled)",
                "dropless, natural routing; cost model assumes "
                "balance (published 465 TF with forced balance)",
                "throughput only a script comment",
            ],
        ),
    ]


@contextmanager
def dispatcher(name: str):
    """``step`` builds ``PlanCosts`` with the default alltoall dispatcher; for this script only,
    the run's dispatcher (``Candidate`` has no such field)."""
    step.PlanCosts = partial(PlanCosts, dispatcher=name)
    try:
        yield
    finally:
        step.PlanCosts = PlanCosts


def evaluate_run(run: Run, ib_scale: float = 1.0) -> PlanResult:
    profile = get_profile("h100-80gb")
    if ib_scale != 1.0:  # sensitivity only: what a cheaper cross-node all-to-all would give
        profile = profile.perturbed({"ib_bandwidth": ib_scale})
    problem = Problem(run.shape, SEQ, run.gpus, profile, run.global_batch)
    pins = Pins(
        tp=run.tp,
        cp=run.cp,
        pp=run.pp,
        vpp=run.vpp if run.vpp > 1 else None,
        schedule="interleaved-1f1b" if run.vpp > 1 else "1f1b",
        micro_batch=run.micro_batch,
        recompute=run.recompute,
        sequence_parallel=run.tp > 1,
        grad_reduce_buckets=True,  # Megatron's own schedules, as published.py pins them
        even_layers=run.stage_layers is None,
        stage_layers=run.stage_layers,
    )
    candidate = pinned_candidate(problem, pins)  # the planner's own pinned-run candidate (EP 1)
    # MoE bypass (this script only): the same layout with the run's expert sizes
    candidate = replace(candidate, layout=replace(candidate.layout, ep=run.ep, etp=run.etp))
    lay = candidate.layout
    microbatches = problem.global_batch // (lay.dp * candidate.micro_batch)
    full = lay.pp * candidate.vpp * candidate.slices * microbatches <= PREDICT_FULL_UNITS  # as predict()
    with dispatcher(run.dispatcher):
        return evaluate(problem, candidate, full=full, check_memory=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run keys (2a 2b 3a 3b 3b+ 4a 4b 5)")
    parser.add_argument(
        "--ib-scale",
        type=float,
        default=1.0,
        help="multiply the H100 profile's InfiniBand bandwidth (sensitivity of the all-to-all)",
    )
    args = parser.parse_args()
    table = [
        "| run | layout (pinned) | predicted s/step | published s/step | predicted / published "
        "| planner F/token vs file | EP a2a s in it (est.) "
        "| predicted less a2a / published | GiB/GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    f_file = {
        QWEN3_30B.name: F_Q30,
        QWEN3_235B.name: F_Q235,
        DEEPSEEK_V3_MTP.name: F_DS,
        MIXTRAL_8X22B.name: F_MIX,
    }
    for run in runs():
        if args.only and run.key not in args.only:
            continue
        try:
            result = evaluate_run(run, args.ib_scale)
        except Exception as error:  # report where the step evaluation refuses, and go on
            table.append(
                f"| {run.key} {run.what} | — | failed: {type(error).__name__}: {error} | "
                f"{run.published_step:.2f} | — | — | — | — | — |"
            )
            continue
        # exposed all-to-all estimate: expert_comm_time of every F and B of one microbatch on the
        # busiest rank x microbatches (none of it is hidden by these schedules)
        with dispatcher(run.dispatcher):
            schedule, costs, _ = pipeline_of(result.problem, result.candidate, result.simulated_microbatches)
        kinds = (OpKind.F, OpKind.B, OpKind.W) if schedule.splits_backward else (OpKind.F, OpKind.BW)
        per_rank = [0.0] * schedule.pp
        for stage in range(schedule.num_stages):
            per_rank[schedule.placement.rank_of(stage)] += sum(
                costs.expert_comm_time(Op(k, stage, 0, 0)) for k in kinds
            )
        a2a = max(per_rank) * result.microbatches
        c = result.candidate
        f_tok = result.model_flops / (run.global_batch * SEQ)
        ratio = result.step_time / run.published_step
        label = (
            f"{c.layout.label()} VPP{c.vpp} {c.schedule}, MBS{c.micro_batch} GBS{run.global_batch}, "
            f"{run.dispatcher}"
        )
        table.append(
            f"| {run.key} {run.what} | {label} | {result.step_time:.2f} | {run.published_step:.2f} "
            f"({run.published}) | **{ratio:.2f}** | {f_tok:.3e} / {f_file[run.shape.name]:.3e} | "
            f"{a2a:.2f} | {(result.step_time - a2a) / run.published_step:.2f} | {result.memory_gib:.0f} |"
        )
        notes.append(
            f"* {run.key}: pipeline {result.pipeline_time:.2f} s, bubble {result.bubble:.1%}, grad sync "
            f"exposed {result.grad_sync_exposed:.2f} s, optimizer {result.optimizer_time:.2f} s, "
            f"param gather {result.param_gather_exposed:.2f} s; published = {run.derivation}. "
            + "; ".join(run.assumptions)
        )
    print("\n".join(table))
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
