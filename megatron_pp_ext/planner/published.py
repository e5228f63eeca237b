"""Published runs and configurations the planner is checked against (docs/planner.md).

Each run is a model, a layout and a measured throughput from its authors; :func:`predict`
simulates the same configuration with the planner's cost model and returns the predicted step
time beside the published one (derived from the authors' own FLOP count and throughput), so
the error is the same whether read as time, TFLOP/s or MFU.

    python -m megatron_pp_ext.planner.published     # prints the tables of docs/planner.md
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.models import ModelShape
from .devices import DeviceProfile, get_profile
from .layout import Layout
from .step import Candidate, PlanResult, Problem, evaluate


def gpt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    """GPT-3-style model of the Megatron papers: 4h GeLU MLP, multi-head, 51,200 vocabulary."""
    return ModelShape(name, layers, hidden, heads, heads, hidden // heads, 4 * hidden, 51200, gated=False)


LLAMA3_405B = ModelShape("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256)


@dataclass(frozen=True)
class PublishedRun:
    source: str
    shape: ModelShape
    gpu: str
    seq_length: int
    layout: Layout
    global_batch: int
    micro_batch: int
    schedule: str
    vpp: int
    recompute: str
    published: str  # what the authors report, as they report it
    published_step: float  # seconds per step derived from it (see ``derivation``)
    derivation: str


def narayanan_step(shape: ModelShape, batch: int, seq: int, tflops: float, gpus: int) -> float:
    """Narayanan et al. 2021, eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step
    (full recomputation included), so step = F / (throughput x GPUs)."""
    h, layers, v = shape.hidden, shape.layers, shape.vocab
    flops = 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + v / (16 * layers * h))
    return flops / (tflops * 1e12 * gpus)


_K22 = "Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, configs Table 3; Megatron-LM README"
_N21 = "Narayanan et al. 2021 (arXiv 2104.04473) Table 1"
_L3 = "Llama 3 (Dubey et al. 2024, arXiv 2407.21783) Table 4"


def published_runs() -> list[PublishedRun]:
    runs: list[PublishedRun] = []
    # Korthikanti: sequence parallel + selective recompute (a flash kernel saves the same), DP 1,
    # A100 80GB, s = 2048; the 175B and 530B runs use the interleaved schedule with 3 chunks.
    for shape, t, p, gpus, batch, micro, schedule, vpp, mfu, seconds in (
        (gpt("gpt-22b", 48, 6144, 64), 8, 1, 8, 4, 4, "1f1b", 1, 0.415, 1.10),
        (gpt("gpt-175b", 96, 12288, 96), 8, 8, 64, 64, 1, "interleaved-1f1b", 3, 0.514, 13.75),
        (gpt("gpt-530b", 105, 20480, 128), 8, 35, 280, 280, 1, "interleaved-1f1b", 3, 0.560, 37.83),
        (gpt("gpt-1t", 128, 25600, 160), 8, 64, 512, 512, 1, "1f1b", 1, 0.563, 71.49),
    ):
        runs.append(
            PublishedRun(
                _K22,
                shape,
                "a100-80gb",
                2048,
                Layout(t, 1, p, gpus // (t * p)),
                batch,
                micro,
                schedule,
                vpp,
                "none",
                f"MFU {mfu:.1%}, {seconds} s/iteration",
                seconds,
                "the published iteration time (Table 5)",
            )
        )
    # Narayanan: full recomputation, A100 80GB, s = 2048, with data parallelism.
    for shape, t, p, gpus, micro, batch, tflops in (
        (gpt("gpt-145b", 80, 12288, 96), 8, 8, 1536, 2, 2304, 148),
        (gpt("gpt-310b", 96, 16384, 128), 8, 16, 1920, 1, 2160, 155),
        (gpt("gpt-530b", 105, 20480, 128), 8, 35, 2520, 1, 2520, 163),
        (gpt("gpt-1t", 128, 25600, 160), 8, 64, 3072, 1, 3072, 163),
    ):
        runs.append(
            PublishedRun(
                _N21,
                shape,
                "a100-80gb",
                2048,
                Layout(t, 1, p, gpus // (t * p)),
                batch,
                micro,
                "1f1b",
                1,
                "full",
                f"{tflops} TFLOP/s per GPU",
                narayanan_step(shape, batch, 2048, tflops, gpus),
                "their eq. 3 FLOPs / (TFLOP/s x GPUs)",
            )
        )
    # Llama 3 405B on H100 (RoCE 400 Gb/s per GPU), 16M tokens per step.
    for gpus, c, d, seq, per_dp, tflops in ((8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400)):
        batch = d * per_dp
        flops = 6 * _params(LLAMA3_405B) * batch * seq + _attention_flops(LLAMA3_405B, seq) * batch
        runs.append(
            PublishedRun(
                _L3,
                LLAMA3_405B,
                "h100-80gb",
                seq,
                Layout(8, c, 16, d),
                batch,
                1,
                "interleaved-1f1b",
                2,
                "none",
                f"{tflops} TFLOP/s per GPU (BF16 MFU {tflops / 989:.0%})",
                flops / (tflops * 1e12 * gpus),
                "6N + causal attention FLOPs per token / (TFLOP/s x GPUs)",
            )
        )
    return runs


def _params(shape: ModelShape) -> int:
    return shape.total_params()


def _attention_flops(shape: ModelShape, seq: int) -> float:
    """Forward + backward attention FLOPs of one causal sequence (3 x forward)."""
    return 3 * shape.layers * shape.attention_flops_per_pair() * seq * (seq + 1) / 2


def predict(run: PublishedRun, profile: DeviceProfile | None = None) -> PlanResult:
    """The run's configuration through the planner's cost model and simulator (every microbatch)."""
    problem = Problem(
        run.shape,
        run.seq_length,
        run.layout.gpus,
        profile or get_profile(run.gpu),
        run.global_batch,
        run.micro_batch,
    )
    candidate = Candidate(run.layout, run.schedule, run.vpp, 1, "none", run.recompute)
    full = run.layout.pp * run.vpp * problem.global_batch <= 40_000
    return evaluate(problem, candidate, full=full, check_memory=False)


# SlimPipe (arXiv 2504.14519) on 256 Hopper 80GB GPUs, Llama 70B: (seq, t, c, p, d, slices, chunks)
SLIMPIPE_CONFIGS = (
    (65536, 8, 1, 4, 8, 4, 20),
    (131072, 8, 1, 8, 4, 8, 10),
    (262144, 4, 2, 8, 4, 16, 10),
    (524288, 4, 2, 16, 2, 32, 5),
)


def main() -> None:
    print("| source | model | layout | published | published s/step | predicted s/step | error |")
    print("|---|---|---|---|---|---|---|")
    for run in published_runs():
        plan = predict(run)
        error = plan.step_time / run.published_step - 1
        lay = run.layout
        layout = f"TP{lay.tp} PP{lay.pp} DP{lay.dp} {run.schedule} v{run.vpp}, recompute {run.recompute}"
        print(
            f"| {run.source.split(' (')[0]} | {run.shape.name} | {layout} | {run.published} | "
            f"{run.published_step:.2f} | {plan.step_time:.2f} | {error:+.1%} |"
        )


if __name__ == "__main__":
    main()
