"""Published mixture-of-experts runs, each as the ``pretrain_gpt.py`` command line of its published
layout, predicted the way ``plan --from-args`` predicts a line (docs/moe_published_runs.md has the
sources and every field; docs/planner.md the comparison).

    python -m megatron_pp_ext.planner.published_moe     # the table of docs/planner.md

The published step time is the source's own seconds per step, or GBS x seq x F_tok / (TFLOP/s x
10^12 x GPUs) with F_tok Megatron's FLOP count of the model (docs/moe_published_runs.md), or GBS x
seq / (tokens/s per GPU x GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .devices import get_profile
from .megatron_args import read_args
from .predict import predict
from .step import PlanResult

SEQ = 4096

# Megatron's FLOPs per token (forward and backward) of each model at 4096 tokens
# (docs/moe_published_runs.md, "How to convert"): the published TFLOP/s back into seconds.
F_TOKEN = {
    "qwen3-30b-a3b": 2.3006e10,
    "qwen3-235b-a22b": 1.4803e11,
    "deepseek-v3": 2.5999e11,
    "mixtral-8x22b": 2.4220e11,
}

COMMON = (
    "--seq-length 4096 --micro-batch-size 1 --bf16 --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --moe-grouped-gemm --swiglu"
)
MODELS = {
    "qwen3-30b-a3b": (
        "--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --vocab-size 151936 "
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768"
    ),
    "qwen3-235b-a22b": (
        "--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --vocab-size 151936 "
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536"
    ),
    # MLA as the line's GQA fallback (128 heads of 128, 2 KV groups: the fewest TP 2 divides)
    "deepseek-v3": (
        "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
        "--multi-latent-attention --group-query-attention --num-query-groups 2 --kv-channels 128 "
        "--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
        "--vocab-size 129280 --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
        "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq '([0]*3+[1]*58)' "
        "--moe-router-num-groups 8 --moe-router-group-topk 4 --mtp-num-layers 1"
    ),
    "mixtral-8x22b": (
        "--num-layers 56 --hidden-size 6144 --ffn-hidden-size 16384 --num-attention-heads 48 "
        "--group-query-attention --num-query-groups 8 --kv-channels 128 --vocab-size 32768 "
        "--num-experts 8 --moe-router-topk 2"
    ),
}
DEEPSEEK_LAYOUT = (
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 "
    "--pipeline-model-parallel-layout 'Et|(tt|)*30mL' --expert-model-parallel-size 64 "
    "--expert-tensor-parallel-size 1"
)
QWEN235_LAYOUT = (
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 "
    "--num-virtual-stages-per-pipeline-rank 4 --account-for-embedding-in-pipeline-split "
    "--account-for-loss-in-pipeline-split --expert-model-parallel-size 32 --expert-tensor-parallel-size 1"
)


@dataclass(frozen=True)
class PublishedMoeRun:
    key: str  # docs/moe_published_runs.md's run number
    what: str
    model: str  # MODELS key
    nodes: int  # of 8 H100s
    flags: str  # layout, batch, dispatcher, precision, overlap
    published: str  # as the source reports it
    published_step: float  # seconds per step derived from it
    derivation: str

    @property
    def command(self) -> str:
        return (
            f"torchrun --nproc-per-node 8 --nnodes {self.nodes} pretrain_gpt.py {MODELS[self.model]} "
            f"{COMMON} {self.flags}"
        )

    @property
    def bf16(self) -> bool:
        return "--fp8-format" not in self.flags

    def predict(self) -> PlanResult:
        """The line through ``plan --from-args``'s path: read, then predicted pinned."""
        run = read_args(self.command)
        problem = run.problem(get_profile("h100-80gb"))
        return predict(problem, run.pins)

    def notes(self) -> list[str]:
        return read_args(self.command).notes


def _tflops(model: str, batch: int, tflops: float, gpus: int) -> float:
    return batch * SEQ * F_TOKEN[model] / (tflops * 1e12 * gpus)


def _tokens(batch: int, tokens_per_gpu: float, gpus: int) -> float:
    return batch * SEQ / (tokens_per_gpu * gpus)


TF, TOK, SEC = "GBS x seq x F_tok / (TFLOP/s x GPUs)", "GBS x seq / (tokens/s/GPU x GPUs)", "published s/step"


def published_moe_runs() -> list[PublishedMoeRun]:
    zoo = PublishedMoeRun(
        "3b", "Qwen3-235B-A22B, MoE Model Zoo, BF16, no EP overlap", "qwen3-235b-a22b", 32,
        f"{QWEN235_LAYOUT} --global-batch-size 2048 --moe-token-dispatcher-type flex",
        "19.7 s/step", 19.7, SEC,
    )  # fmt: skip
    zoo_overlap = replace(
        zoo, key="3b+", what="Qwen3-235B-A22B, MoE Model Zoo, BF16, EP overlap", published="17.6 s/step",
        published_step=17.6, flags=f"{zoo.flags} --overlap-moe-expert-parallel-comm",
    )  # fmt: skip
    return [
        PublishedMoeRun(
            "2a", "DeepSeek-V3, Megatron-Bridge 25.09, FP8, EP overlap", "deepseek-v3", 128,
            f"{DEEPSEEK_LAYOUT} --global-batch-size 8192 --moe-token-dispatcher-type flex --fp8-format e4m3 "
            "--overlap-moe-expert-parallel-comm",
            "1297 tokens/s/GPU", _tokens(8192, 1297, 1024), TOK,
        ),
        PublishedMoeRun(
            "2b", "DeepSeek-V3, Megatron-Bridge card, BF16", "deepseek-v3", 128,
            f"{DEEPSEEK_LAYOUT} --global-batch-size 16384 --moe-token-dispatcher-type flex",
            "61.756 s/step", 61.756, SEC,
        ),
        PublishedMoeRun(
            "3a", "Qwen3-235B-A22B, Megatron-Bridge 26.04.01, FP8, EP overlap", "qwen3-235b-a22b", 32,
            f"{QWEN235_LAYOUT} --global-batch-size 8192 --moe-token-dispatcher-type alltoall "
            "--fp8-format hybrid --overlap-moe-expert-parallel-comm",
            "253 TFLOP/s/GPU", _tflops("qwen3-235b-a22b", 8192, 253, 256), TF,
        ),
        zoo,
        zoo_overlap,
        PublishedMoeRun(
            "4a", "Qwen3-30B-A3B, Megatron-Bridge card, BF16, EP overlap", "qwen3-30b-a3b", 2,
            "--expert-model-parallel-size 16 --global-batch-size 1024 --moe-token-dispatcher-type flex "
            "--overlap-moe-expert-parallel-comm",
            "20.147 s/step", 20.147, SEC,
        ),
        PublishedMoeRun(
            "4b", "Qwen3-30B-A3B, Megatron-Bridge 26.06, FP8", "qwen3-30b-a3b", 2,
            "--expert-model-parallel-size 16 --global-batch-size 1024 --moe-token-dispatcher-type flex "
            "--fp8-format hybrid",
            "8826 tokens/s/GPU", _tokens(1024, 8826, 16), TOK,
        ),
        PublishedMoeRun(
            "5", "Mixtral 8x22B, MoE Model Zoo (script comment), BF16", "mixtral-8x22b", 16,
            "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 "
            "--num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 8 "
            "--expert-tensor-parallel-size 1 --global-batch-size 256 --moe-token-dispatcher-type alltoall",
            "~445 TFLOP/s/GPU", _tflops("mixtral-8x22b", 256, 445, 128), TF,
        ),
    ]  # fmt: skip


def main() -> None:
    print(
        "| run | predicted s/step | published s/step | predicted / published | TFLOP/s/GPU | MFU | "
        "all-to-all s on the busiest rank (most a rank's pairs hide) | GiB/GPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in published_moe_runs():
        plan = run.predict()
        experts = plan.experts
        assert experts is not None
        print(
            f"| {run.key} {run.what} | {plan.step_time:.2f} | {run.published_step:.2f} ({run.published}) | "
            f"**{plan.step_time / run.published_step:.2f}** | {plan.tflops_per_gpu:.0f} | {plan.mfu:.1%} | "
            f"{experts.alltoall_seconds:.2f} ({experts.hidden_seconds:.2f}) | {plan.memory_gib:.1f} |"
        )


if __name__ == "__main__":
    main()
