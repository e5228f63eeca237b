"""Published runs and configurations the planner is checked against (docs/planner.md).

Each run is a model, a layout and a measured throughput from its authors; :func:`predict`
simulates the same configuration with the planner's cost model and returns the predicted step
time beside the published one (derived from the authors' own FLOP count and throughput), so
the error is the same whether read as time, TFLOP/s or MFU.

    python -m megatron_pp_ext.planner.published     # prints the tables of docs/planner.md
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..schedule.memory_model import padded_vocab
from ..schedule.models import ModelShape
from .devices import DeviceProfile, get_profile
from .layout import Layout
from .pins import Pins
from .predict import predict as predict_pinned
from .search import chunk_options, search
from .step import PlanResult, Problem


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
    vpp: int | None  # None: not published, the best of Megatron's own schedules' chunk counts
    recompute: str
    published: str  # what the authors report, as they report it
    published_step: float  # seconds per step derived from it (see ``derivation``)
    derivation: str
    tp_comm_overlap: bool = False
    attention: str = "flash"

    def pins(self) -> Pins:
        lay = self.layout
        return Pins(
            tp=lay.tp,
            cp=lay.cp,
            pp=lay.pp,
            vpp=self.vpp,
            sequence_parallel=lay.sequence_parallel and lay.tp > 1,
            distributed_optimizer=lay.distributed_optimizer,
            recompute=self.recompute,
            schedule=None if self.vpp is None else self.schedule,
            micro_batch=self.micro_batch,
            tp_comm_overlap=self.tp_comm_overlap,
            grad_reduce_buckets=True,  # Megatron's own schedules (Llama 3: its own, alike)
            attention=self.attention,
            even_layers=self.shape.layers % lay.pp == 0,
        )

    def label(self) -> str:
        lay = self.layout
        chunks = "v best" if self.vpp is None else f"v{self.vpp}"
        schedule = "Megatron's 1f1b or interleaved" if self.vpp is None else self.schedule
        extra = ", TP overlap" if self.tp_comm_overlap else ""
        return f"TP{lay.tp} PP{lay.pp} DP{lay.dp} {schedule} {chunks}, recompute {self.recompute}{extra}"


def narayanan_step(shape: ModelShape, batch: int, seq: int, tflops: float, gpus: int) -> float:
    """Narayanan et al. 2021, eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step
    (full recomputation included), so step = F / (throughput x GPUs)."""
    h, layers, v = shape.hidden, shape.layers, shape.vocab
    flops = 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + v / (16 * layers * h))
    return flops / (tflops * 1e12 * gpus)


def megatron_2024_flops(shape: ModelShape, batch: int, seq: int) -> float:
    """Megatron-LM's own count when its H100 table was measured (``num_floating_point_operations``
    in megatron/training/training.py at commit f2e5db4, July 2024, the table's commit): 12 B s L h^2
    ((1 + g/a + s/h) ad/h + f/h x 3/2 if SwiGLU + V/(2 L h)), forward and backward, attention over
    all s^2 (query, key) pairs (later releases halve it for the causal mask)."""
    h, layers = shape.hidden, shape.layers
    attention = (1 + shape.kv_heads / shape.heads + seq / h) * shape.q_width / h
    mlp = shape.ffn / h * (1.5 if shape.gated else 1.0)
    logits = padded_vocab(shape.vocab, 1) / (2 * layers * h)
    return 12 * batch * seq * layers * h * h * (attention + mlp + logits)


_K22 = "Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, configs Table 3; Megatron-LM README"
_N21 = "Narayanan et al. 2021 (arXiv 2104.04473) Table 1"
_L3 = "Llama 3 (Dubey et al. 2024, arXiv 2407.21783) Table 4"
_M24 = "Megatron-LM README (commit f2e5db4, July 2024), images/model_table.png"


def published_runs() -> list[PublishedRun]:
    runs: list[PublishedRun] = []
    # Korthikanti: sequence parallel + selective recompute (of the unfused attention's score
    # matrix: 2022's Megatron had no flash kernel), DP 1, A100 80GB, s = 2048; the 175B and 530B
    # runs use the interleaved schedule with 3 chunks.
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
                "selective",
                f"MFU {mfu:.1%}, {seconds} s/iteration",
                seconds,
                "the published iteration time (Table 5)",
                attention="unfused",
            )
        )
    # Narayanan: full recomputation, A100 80GB, s = 2048, with data parallelism; 2021's Megatron
    # had neither sequence parallelism, the distributed optimizer nor a flash kernel.
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
                Layout(t, 1, p, gpus // (t * p), sequence_parallel=False, distributed_optimizer=False),
                batch,
                micro,
                "1f1b",
                1,
                "full",
                f"{tflops} TFLOP/s per GPU",
                narayanan_step(shape, batch, 2048, tflops, gpus),
                "their eq. 3 FLOPs / (TFLOP/s x GPUs)",
                attention="unfused",
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
    # Megatron-LM's H100 weak-scaling table: GPT models, V 131072, s 4096, DP 48, BF16, with
    # --overlap-grad-reduce --overlap-param-gather (so the distributed optimizer), --tp-comm-overlap
    # (so sequence parallelism). Micro-batch size and schedule are not published: Megatron's
    # defaults, 1 and 1F1B (no --num-layers-per-virtual-pipeline-stage), as --from-args reads a
    # command line that does not give them.
    for name, heads, hidden, layers, t, p, batch, tflops in (
        ("gpt-1.7b", 16, 2048, 24, 1, 1, 192, 408.8),
        ("gpt-7.1b", 32, 4096, 30, 2, 1, 192, 465.9),
        ("gpt-16b", 48, 6144, 32, 4, 1, 192, 489.1),
        ("gpt-32b", 56, 7168, 48, 8, 1, 192, 459.6),
        ("gpt-70b", 64, 8192, 84, 8, 2, 384, 419.7),
        ("gpt-119b", 80, 10240, 92, 8, 4, 768, 420.5),
        ("gpt-177b", 96, 12288, 96, 8, 6, 1152, 432.8),
        ("gpt-314b", 128, 16384, 96, 8, 8, 1536, 474.4),
        ("gpt-462b", 144, 18432, 112, 8, 16, 3072, 459.9),
    ):
        shape = replace(gpt(name, layers, hidden, heads), vocab=131072)
        gpus = t * p * 48
        runs.append(
            PublishedRun(
                _M24,
                shape,
                "h100-80gb",
                4096,
                Layout(t, 1, p, 48),
                batch,
                1,
                "1f1b",
                1,
                "none",
                f"{tflops} TFLOP/s per GPU",
                megatron_2024_flops(shape, batch, 4096) / (tflops * 1e12 * gpus),
                "Megatron-LM's 2024 FLOP count / (TFLOP/s x GPUs)",
                tp_comm_overlap=t > 1,
            )
        )
    return runs


def _params(shape: ModelShape) -> int:
    return shape.total_params()


def _attention_flops(shape: ModelShape, seq: int) -> float:
    """Forward + backward attention FLOPs of one causal sequence (3 x forward)."""
    return 3 * shape.layers * shape.attention_flops_per_pair() * seq * (seq + 1) / 2


def problem_of(run: PublishedRun, profile: DeviceProfile | None = None) -> Problem:
    return Problem(
        run.shape,
        run.seq_length,
        run.layout.gpus,
        profile or get_profile(run.gpu),
        run.global_batch,
    )


def predict(run: PublishedRun, profile: DeviceProfile | None = None) -> PlanResult:
    """The run's configuration through the planner's cost model and simulator, pinned as
    published (every microbatch replayed). Chunks per rank that the source does not give are
    searched over Megatron's own schedules (1F1B and interleaved), as a tuned run would pick them."""
    problem = problem_of(run, profile)
    if run.vpp is not None:
        return predict_pinned(problem, run.pins())
    result = search(problem, top=1, schedules=["1f1b", "interleaved-1f1b"], pins=run.pins())
    if result.plans:
        return result.plans[0]
    # nothing fits by our accounting: the fastest of the choices, memory not checked
    plans = [
        predict_pinned(problem, replace(run.pins(), schedule=name, vpp=vpp))
        for name in ("1f1b", "interleaved-1f1b")
        for vpp in ([1] if name == "1f1b" else chunk_options(name, run.shape.layers, run.layout.pp))
    ]
    return min(plans, key=lambda plan: plan.step_time)


# SlimPipe (arXiv 2504.14519) on 256 Hopper 80GB GPUs, Llama 70B: (seq, t, c, p, d, slices, chunks)
SLIMPIPE_CONFIGS = (
    (65536, 8, 1, 4, 8, 4, 20),
    (131072, 8, 1, 8, 4, 8, 10),
    (262144, 4, 2, 8, 4, 16, 10),
    (524288, 4, 2, 16, 2, 32, 5),
)


def slimpipe_table() -> None:
    """docs/planner.md's Llama-2 70B table: the planner's top plan on 256 H100s at each of
    SlimPipe's sequence lengths, beside SlimPipe's own configuration (4M tokens per step)."""
    from ..configs import shape as config_shape

    shape = config_shape("llama2-70b")
    profile = get_profile("h100-80gb")
    print(
        "| tokens | top plan | step s | tok/s/GPU | MFU | GiB/GPU | bubble | SlimPipe config | step s | MFU "
        "| GiB/GPU (fits?) | with offload auto |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seq, t, c, p, d, slices, chunks in SLIMPIPE_CONFIGS:
        problem = Problem(shape, seq, 256, profile, max(1, (1 << 22) // seq))
        best = search(problem, top=1).plans[0]
        pins = Pins(
            tp=t,
            cp=c,
            pp=p,
            vpp=chunks,
            schedule="slimpipe-interleaved",
            slices=slices,
            offload="none",
            micro_batch=1,
        )
        theirs = predict_pinned(problem, pins)
        offloaded = predict_pinned(problem, replace(pins, offload="auto"))
        fits = "yes" if theirs.fits else "no"
        print(
            f"| {seq // 1024}K | {best.candidate.label()} | {best.step_time:.2f} | "
            f"{best.tokens_per_s_per_gpu:.0f} | {best.mfu:.1%} | {best.memory_gib:.1f} | {best.bubble:.3f} | "
            f"t{t} c{c} p{p} d{d} n{slices} v{chunks} | {theirs.step_time:.2f} | {theirs.mfu:.1%} | "
            f"{theirs.memory_gib:.1f} ({fits}) | {offloaded.step_time:.2f} s, "
            f"{offloaded.memory_gib:.1f} GiB |"
        )


def main() -> None:
    print("| source | model | layout | published | published s/step | predicted s/step | error |")
    print("|---|---|---|---|---|---|---|")
    for run in published_runs():
        plan = predict(run)
        error = plan.step_time / run.published_step - 1
        layout = run.label()
        if run.vpp is None:
            layout += f" (predicted: {plan.candidate.schedule} v{plan.candidate.vpp})"
        print(
            f"| {run.source.split(' (')[0]} | {run.shape.name} | {layout} | {run.published} | "
            f"{run.published_step:.2f} | {plan.step_time:.2f} | {error:+.1%} |"
        )


if __name__ == "__main__":
    import sys

    slimpipe_table() if sys.argv[1:] == ["--slimpipe"] else main()
