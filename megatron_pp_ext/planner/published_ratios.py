"""Schedule ratios against the Zero Bubble paper's measurements (docs/planner.md).

Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241; the
tables are the same in v1 and in the ICLR version): four GPT-3-like models on A100 SXM 80GB (up to
4 nodes over RoCE), TP1 DP1, PP = GPUs, measured under 1F1B, interleaved 1F1B (1F1B-I), ZB-1p
and ZB-2p. Their vocabulary and the rest of their software are not all published, so absolute
throughput is uncertain; the ratio of two schedules on the same model, layout and batch depends
on the bubbles, what our simulator claims, and hardly on those unknowns.

Each row is predicted through the planner (``step.evaluate``, every microbatch replayed, pinned as
``published.py`` pins its rows), one run per schedule; the ZB rows also as the paper ran them, with
the optimizer post-validation of their section 4 (``schedule/iterations.py`` over the planner's
cost model), which the planner's step time does not model.

    python -m megatron_pp_ext.planner.published_ratios     # prints the table of docs/planner.md
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..schedule.iterations import simulate_iterations
from ..schedule.models import ModelShape
from .devices import get_profile
from .kernels import Kernels
from .pins import Pins
from .predict import pinned_candidate
from .published import gpt
from .step import Candidate, PlanResult, Problem, evaluate, pipeline_of

SOURCE = (
    "Qi, Wan, Huang, Lin, Zero Bubble Pipeline Parallelism, ICLR 2024 (arXiv 2401.10241): "
    "Table 3 (models), Table 4 (measured samples per GPU per second), Table 5 (bubble rates)"
)
SEQ_LENGTH = 1024  # Table 3
VOCAB = 32000  # not published: the size that gives Table 3's parameter counts (``ZBModel.params``)
POSITIONS = 2048  # --max-position-embeddings of the authors' examples/pretrain_zero_bubble.sh
GPU = "a100-80gb"
SCHEDULES = ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p")  # Table 4's rows
PAIRS = ("1F1B-I", "ZB-1p", "ZB-2p")  # each against 1F1B on the same model, layout and batch


@dataclass(frozen=True)
class ZBModel:
    """One model of Table 3, its setup (PP = GPUs, TP1, DP1) and the paper's numbers for it."""

    name: str
    layers: int
    hidden: int
    heads: int
    micro_batch: int
    pp: int
    microbatches: tuple[int, ...]
    measured: dict[str, tuple[float, ...]]  # Table 4: samples per GPU per second, per microbatch count
    bubble: dict[str, tuple[float, ...]]  # Table 5: bubble rates from their profiled times

    def shape(self) -> ModelShape:
        return replace(gpt(f"zb-{self.name.lower()}", self.layers, self.hidden, self.heads), vocab=VOCAB)

    def params(self, vocab: int = VOCAB, tied: bool = True) -> int:
        """Megatron's GPT of 2023: layers with biases and two LayerNorms (12h^2 + 13h), word and
        learned position embeddings, final LayerNorm; the output layer tied to the word embedding
        (Megatron's default) or not. With ``VOCAB`` and tied: 1.48, 6.18, 14.65, 28.30 B, Table
        3's names; GPT-2's 50257 (padded to 50304) gives 1.52, 6.26, 14.74, 28.41 B, and untied
        32000 1.55, 6.30, 14.80, 28.48 B, which do not all round to them."""
        h = self.hidden
        words = vocab * h * (1 if tied else 2)
        return self.layers * (12 * h * h + 13 * h) + words + POSITIONS * h + 2 * h


ZB_MODELS = (
    ZBModel(
        "1.5B", 22, 2304, 24, 6, 8, (24, 32, 64),
        {"ZB-2p": (14.5, 14.8, 14.9), "ZB-1p": (12.9, 13.4, 14.2), "1F1B": (11.8, 12.5, 13.6),
         "1F1B-I": (13.1, 13.4, 13.9)},
        {"1F1B": (0.2431, 0.1985, 0.1240), "1F1B-I": (0.1055, 0.0818, 0.0443),
         "ZB-1p": (0.1585, 0.1242, 0.0674), "ZB-2p": (0.0433, 0.0039, 0.0026)},
    ),
    ZBModel(
        "6.2B", 30, 4096, 32, 3, 8, (24, 32, 64),
        {"ZB-2p": (4.32, 4.35, 4.39), "ZB-1p": (3.88, 4.00, 4.20), "1F1B": (3.50, 3.70, 4.03),
         "1F1B-I": (4.01, 4.08, 4.19)},
        {"1F1B": (0.2347, 0.1898, 0.1091), "1F1B-I": (0.0808, 0.0628, 0.0320),
         "ZB-1p": (0.1323, 0.1045, 0.0554), "ZB-2p": (0.0029, 0.0022, 0.0010)},
    ),
    ZBModel(
        "14.6B", 46, 5120, 40, 1, 16, (48, 64, 128),
        {"ZB-2p": (1.81, 1.83, 1.85), "ZB-1p": (1.61, 1.67, 1.76), "1F1B": (1.40, 1.49, 1.64),
         "1F1B-I": (1.54, 1.59, 1.66)},
        {"1F1B": (0.2552, 0.2082, 0.1251), "1F1B-I": (0.1104, 0.0852, 0.0445),
         "ZB-1p": (0.1397, 0.1088, 0.0576), "ZB-2p": (0.0066, 0.0054, 0.0028)},
    ),
    ZBModel(
        "28.3B", 62, 6144, 48, 1, 32, (96, 128, 256),
        {"ZB-2p": (0.99, 1.00, 1.00), "ZB-1p": (0.87, 0.90, 0.96), "1F1B": (0.76, 0.80, 0.88),
         "1F1B-I": (0.82, 0.85, 0.90)},
        {"1F1B": (0.2646, 0.2168, 0.1352), "1F1B-I": (0.1493, 0.1164, 0.0624),
         "ZB-1p": (0.1421, 0.1106, 0.0594), "ZB-2p": (0.0038, 0.0029, 0.0018)},
    ),
)  # fmt: skip


def problem_of(model: ZBModel, microbatches: int) -> Problem:
    return Problem(model.shape(), SEQ_LENGTH, model.pp, get_profile(GPU), microbatches * model.micro_batch)


def candidate_of(model: ZBModel, microbatches: int, schedule: str) -> Candidate:
    """The paper's run of ``schedule`` (Table 4's name), pinned: TP1 DP1, PP = GPUs, the
    micro-batch size of Table 3, no recomputation, Megatron's attention of 2023 (no flash kernel),
    first and last stage one layer short; 1F1B-I with one layer per chunk, the first and the
    last chunk empty (``--allow-padding-num-layers``); ZB-1p and ZB-2p the automatic scheduler
    under 1x and 2x 1F1B's activation memory."""
    p, layers = model.pp, model.layers
    name, vpp, memory_limit, split = {
        "1F1B": ("1f1b", 1, None, None),
        "1F1B-I": ("interleaved-1f1b", (layers + 2) // p, None, "padded"),
        "ZB-1p": ("zb-auto", 1, 1.0, None),
        "ZB-2p": ("zb-auto", 1, 2.0, None),
    }[schedule]
    pins = Pins(
        tp=1,
        cp=1,
        pp=p,
        vpp=vpp,
        sequence_parallel=False,
        distributed_optimizer=False,
        recompute="none",
        schedule=name,
        micro_batch=model.micro_batch,
        grad_reduce_buckets=True,
        attention="unfused",
        even_layers=False,
    )
    candidate = pinned_candidate(problem_of(model, microbatches), pins)
    if split == "padded":  # (layers + 2) / (p v) = 1 layer per chunk, less the two padded ones
        candidate = replace(candidate, layers=(0,) + (1,) * (p * vpp - 2) + (0,))
    return replace(candidate, memory_limit=memory_limit)


def predict(model: ZBModel, microbatches: int, schedule: str) -> PlanResult:
    """The planner's step (every microbatch replayed, memory reported, not checked)."""
    problem = problem_of(model, microbatches)
    return evaluate(problem, candidate_of(model, microbatches, schedule), full=True, check_memory=False)


def post_validated_step(model: ZBModel, microbatches: int, schedule: str, plan: PlanResult) -> float:
    """Seconds per iteration in the steady state with Zero Bubble's optimizer post-validation
    (their section 4; ``iterations.py``): each rank steps as soon as its part is done and starts
    the next iteration up to its validation gate, so consecutive iterations overlap. The step
    itself is the planner's optimizer time; the global check an all-reduce of a few floats."""
    problem = problem_of(model, microbatches)
    candidate = plan.candidate
    schedule_, costs, _ = pipeline_of(problem, candidate, microbatches)
    kernels, intra = Kernels(problem.profile), candidate.layout.pp_intra
    result = simulate_iterations(
        schedule_,
        costs,
        iterations=3,
        optimizer="post-validation",
        optimizer_time=plan.optimizer_time,
        reduce_time=2 * kernels.collective(16, model.pp, intra),
        hop_time=kernels.p2p(16, intra),
    )
    return result.period


@dataclass(frozen=True)
class RatioRow:
    model: ZBModel
    microbatches: int
    schedule: str  # against 1F1B
    measured: float  # Table 4: throughput of ``schedule`` / throughput of 1F1B
    paper: float  # what Table 5's bubble rates imply: (1 - bubble) / (1 - bubble of 1F1B)
    predicted: float  # the planner: 1F1B's step time / ``schedule``'s
    post_validated: float | None  # ZB rows: with post-validation (``post_validated_step``)

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def post_validated_error(self) -> float | None:
        return None if self.post_validated is None else self.post_validated / self.measured - 1


def ratio_rows(models: tuple[ZBModel, ...] = ZB_MODELS) -> list[RatioRow]:
    rows = []
    for model in models:
        for index, m in enumerate(model.microbatches):
            plans = {name: predict(model, m, name) for name in SCHEDULES}
            base = plans["1F1B"].step_time
            for name in PAIRS:
                post = None
                if name.startswith("ZB"):
                    post = base / post_validated_step(model, m, name, plans[name])
                rows.append(
                    RatioRow(
                        model,
                        m,
                        name,
                        model.measured[name][index] / model.measured["1F1B"][index],
                        (1 - model.bubble[name][index]) / (1 - model.bubble["1F1B"][index]),
                        base / plans[name].step_time,
                        post,
                    )
                )
    return rows


def main() -> None:
    print(
        "| model | p | m | pair | measured | Table 5 bubbles | predicted | error "
        "| with post-validation | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in ratio_rows():
        post = (
            ""
            if row.post_validated is None
            else f"{row.post_validated:.3f} | {row.post_validated_error:+.1%}"
        )
        print(
            f"| {row.model.name} | {row.model.pp} | {row.microbatches} | {row.schedule} / 1F1B | "
            f"{row.measured:.3f} | {row.paper:.3f} | {row.predicted:.3f} | {row.error:+.1%} | "
            f"{post or '- | -'} |"
        )


if __name__ == "__main__":
    main()
