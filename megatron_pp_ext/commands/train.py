"""``megatron-pp-ext train``: the main job.

A Megatron-style training loop on megatron-core's GPTModel, cut into pipeline stages, with the
schedule chosen by ``--pp-schedule``. It calls megatron-core's ``get_forward_backward_func()``
exactly as Megatron-LM's training loop does; our hook (``megatron_pp_ext.megatron.install``)
makes that return the chosen schedule. Bad input fails in the launching process, before any
worker starts.

Checkpoints (Megatron's ``--save``, ``--save-interval``, ``--load``, ``--ckpt-step``) are
megatron-core ``dist_checkpointing`` checkpoints of global tensors (``megatron/checkpoint.py``):
any schedule, placement or parallel layout loads them, and the run goes on from the saved
iteration and data position, bitwise on the same layout. A step whose gradients hold a NaN or an
inf is skipped and reported; a peer that dies or hangs ends every rank within
``--pp-p2p-timeout`` with the rank, op and peer named, and the last checkpoint intact.

This module is the command: its flags and the launch. The job itself (settings, checks, the
training loop, checkpoints, logs) is the training layer, ``megatron_pp_ext/training/``.
"""

from __future__ import annotations

import argparse

from ..errors import JobError, UsageError
from ..megatron import datasets
from ..megatron.hook import add_args
from ..schedule.layer_split import add_layer_split_args
from ..training.settings import DEFAULT_CONFIG, TrainSettings, load_settings, moe_layer_freq, resolve_layout

__all__ = ["JobError", "UsageError", "add_parser", "run", "settings_from_argv"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a megatron-core GPT with a pipeline schedule (the main job)",
        description="Train a megatron-core GPT over pipeline ranks with the schedule of --pp-schedule.",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"YAML file or a name in configs/ (default {DEFAULT_CONFIG})"
    )
    # Megatron's names (a command line moves to pretrain_gpt.py unchanged); --pp, --iterations
    # and --microbatches are this command's older spellings, kept as aliases.
    parser.add_argument(
        "--pipeline-model-parallel-size", "--pp", dest="pp", type=int, help="pipeline ranks (alias --pp)"
    )
    parser.add_argument("--tensor-model-parallel-size", dest="tp", type=int, help="tensor-parallel ranks")
    parser.add_argument(
        "--sequence-parallel", action="store_true", default=None, help="sequence parallelism (needs TP > 1)"
    )
    parser.add_argument(
        "--context-parallel-size",
        dest="cp",
        type=int,
        help="context-parallel ranks: each holds 2 of 2 x CP pieces of every slice (any schedule)",
    )
    parser.add_argument(
        "--data-parallel-size",
        dest="dp",
        type=int,
        help="data-parallel replicas when train starts the processes itself (under torchrun/srun: "
        "world size / (TP x CP x PP))",
    )
    parser.add_argument(
        "--global-batch-size", type=int, help="sequences per iteration over all data-parallel ranks"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        help="microbatches per iteration per data-parallel rank (instead of --global-batch-size)",
    )
    parser.add_argument("--micro-batch-size", type=int, help="sequences per microbatch")
    parser.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        dest="virtual_stages",
        type=int,
        help="Megatron's: model chunks per pipeline rank (the same as --pp-chunks; give either)",
    )
    _add_model_args(parser)
    add_layer_split_args(parser)
    parser.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        help="Megatron's: nccl (a GPU per rank; the default on GPUs) or gloo (the default on CPU; on "
        "GPUs the ranks share them, messages staged through host memory: a whole pipeline on one GPU)",
    )
    parser.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        help="Megatron's: Transformer Engine's layers, or megatron-core's local ones with fused SDPA "
        "attention (default: TE on a GPU where it imports, for schedules without a B/W split)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 weights and activations (fp32 loss, gradients reduced in fp32), as Megatron-LM's",
    )
    parser.add_argument("--train-iters", "--iterations", dest="iterations", type=int, help="optimizer steps")
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        default=None,
        help="the distributed optimizer's gradient layout (reduce-scatter over DP)",
    )
    parser.add_argument(
        "--overlap-grad-reduce", action="store_true", default=None, help="overlap the DP gradient reduction"
    )
    parser.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="divide the loss by the global batch's token count, not per microbatch (Megatron's "
        "flag; vocabulary parallelism with sequence slices needs it)",
    )
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--min-lr", type=float, help="Megatron's: the learning rate cosine decay ends at")
    parser.add_argument(
        "--lr-warmup-iters", dest="warmup", type=int, help="Megatron's: iterations of linear warm-up"
    )
    parser.add_argument("--weight-decay", type=float, help="Megatron's: AdamW's weight decay")
    parser.add_argument(
        "--clip-grad", type=float, help="clip gradients to this global L2 norm (0: no clipping)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also show megatron-core's start-up warnings (quiet.py)"
    )
    parser.add_argument("--seed", type=int, help="random seed (weights and data)")
    parser.add_argument(
        "--data", help="a byte-level text file to train on (default: Python stdlib docstrings)"
    )
    data = parser.add_argument_group("megatron-core's datasets (Megatron's flags)")
    data.add_argument(
        "--data-path",
        nargs="+",
        help="indexed .bin/.idx dataset prefixes, as Megatron takes them: PREFIX ... or weighted "
        "W1 PREFIX1 W2 PREFIX2 ... (megatron-core's GPTDataset, blended)",
    )
    data.add_argument(
        "--split", help=f"train,valid,test weights over --data-path (default {datasets.DEFAULT_SPLIT})"
    )
    data.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset")
    data.add_argument(
        "--tokenizer-type",
        help="the tokenizer of --data-path/--mock-data: NullTokenizer (ids 0..--vocab-size - 1, "
        "end of document --vocab-size)",
    )
    data.add_argument("--tokenizer-model", help="a tokenizer model (not read by NullTokenizer)")
    data.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary before end-of-document")
    data.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the model's vocabulary to a multiple of this x TP, as Megatron-LM (default 128)",
    )
    parser.add_argument("--metrics", help="write per-iteration metrics here as JSON lines")
    parser.add_argument(
        "--log-interval",
        type=int,
        help="Megatron's: every N iterations one line as Megatron-LM prints it (iteration, consumed "
        "samples, time per iteration, learning rate, batch size, lm loss, grad norm), above the bar",
    )
    parser.add_argument(
        "--eval-interval",
        type=int,
        help="Megatron's: a validation loss (forward only) every N iterations, printed as Megatron-LM "
        "prints it above the bar and written to --metrics",
    )
    parser.add_argument(
        "--eval-iters", type=int, help="Megatron's: iterations (global batches) per validation (default 100)"
    )
    parser.add_argument(
        "--tensorboard-dir",
        help="Megatron's: TensorBoard logs here, with Megatron-LM's tags (lm loss, learning-rate, "
        "grad-norm, iteration-time, batch-size) and each rank's bubble and peak memory at the end",
    )
    parser.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Megatron's: also the validation perplexity (lm loss validation ppl)",
    )
    ckpt = parser.add_argument_group("checkpoints (Megatron's flags)")
    ckpt.add_argument("--save", help="save checkpoints to this directory (iter_XXXXXXX, atomically)")
    ckpt.add_argument("--save-interval", type=int, help="iterations between checkpoints (and one at the end)")
    ckpt.add_argument(
        "--load",
        help="resume from this directory's latest checkpoint (any schedule, placement or parallel "
        "layout may have written it); without one, start from scratch",
    )
    ckpt.add_argument("--ckpt-step", type=int, help="with --load: load this iteration, not the latest")
    ckpt.add_argument("--no-load-optim", action="store_true", help="with --load: fresh optimizer state")
    ckpt.add_argument("--no-load-rng", action="store_true", help="with --load: keep this run's RNG states")
    parser.add_argument(
        "--pp-post-validation",
        action="store_true",
        help="Zero Bubble's optimizer post-validation: each stage steps on a partial reduction of "
        "the gradient norm and NaN/inf state and rolls the step back if the global check fails "
        "(same result as the synchronous step, no wait for the global norm at the iteration end)",
    )
    parser.add_argument(
        "--pp-post-validation-chain",
        choices=("measured", "auto", "up", "down"),
        help="with --pp-post-validation, the order the partial state visits the pipeline ranks: "
        "the order they finish an iteration, as timed over the first iterations (measured, the "
        "default), as the schedule has it at unit costs (auto, reproducible), rank 0 to p-1 (up) "
        "or p-1 to 0 (down)",
    )
    parser.add_argument(
        "--pp-optimizer",
        choices=("auto", "megatron", "torch"),
        default="auto",
        help="Adam from megatron-core (fp32 main weights; GPUs only) or torch's on the model's weights "
        "with Megatron's main_grad (what --pp-post-validation and CPUs use); auto: Megatron's on GPUs",
    )
    add_args(parser)
    parser.set_defaults(run=run, pp_schedule=None, pp_seq_slices=None)  # None: the config's


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's model flags, over the config's model section: a pretrain_gpt.py command line
    of a Llama-style model runs here unchanged (train builds RMSNorm, SwiGLU, rotary, bias-free,
    untied models; the flags that say so are accepted, others refused in one line)."""
    model = parser.add_argument_group("the model (Megatron's flags, over the --config's model section)")
    model.add_argument("--num-layers", type=int, help="transformer layers")
    model.add_argument("--seq-length", type=int, help="tokens per sequence")
    model.add_argument("--hidden-size", type=int, help="hidden width")
    model.add_argument("--num-attention-heads", type=int, help="query heads")
    model.add_argument(
        "--group-query-attention", action="store_true", default=None, help="grouped-query attention"
    )
    model.add_argument("--num-query-groups", type=int, help="with --group-query-attention: key/value heads")
    model.add_argument("--ffn-hidden-size", type=int, help="the MLP's inner width (before SwiGLU's gate)")
    model.add_argument("--max-position-embeddings", type=int, help="at least --seq-length")
    model.add_argument("--rotary-base", type=int, help="rotary embeddings' base")
    model.add_argument("--norm-epsilon", type=float, help="RMSNorm's epsilon")
    model.add_argument("--init-method-std", type=float, help="standard deviation of the initial weights")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        model.add_argument(
            flag, type=float, help="0 (train trains without dropout; Megatron's default is 0.1)"
        )
    model.add_argument("--normalization", help="RMSNorm (what train builds)")
    model.add_argument("--position-embedding-type", help="rope (what train builds)")
    _add_moe_args(parser)
    _add_profile_args(parser)
    for flag, what in (
        ("--swiglu", "SwiGLU MLPs"),
        ("--untie-embeddings-and-output-weights", "an output layer of its own"),
        ("--disable-bias-linear", "no linear-layer biases"),
    ):
        model.add_argument(flag, action="store_true", help=f"{what} (what train builds; accepted)")


def _add_profile_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's profiling flags, with its defaults and window; ``--pp-timeline`` records
    the same window as a timeline beside the simulator's prediction."""
    profile = parser.add_argument_group("profiling (Megatron's flags)")
    profile.add_argument(
        "--profile", action="store_true", default=None, help="NVTX ranges named after our ops, for nsys (GPU)"
    )
    profile.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        default=None,
        help="torch.profiler over the window, each op a named range; trace to --tensorboard-dir",
    )
    profile.add_argument("--profile-step-start", type=int, default=10, help="window start (default 10)")
    profile.add_argument("--profile-step-end", type=int, default=12, help="window end (default 12)")


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's mixture-of-experts flags: every layer (or those ``--moe-layer-freq`` picks)
    gets megatron-core's MoE layer; each sets its TransformerConfig field (the config's
    ``model: extra:``)."""
    moe = parser.add_argument_group("mixture of experts (Megatron's flags)")
    moe.add_argument("--num-experts", type=int, help="experts per MoE layer")
    moe.add_argument("--moe-ffn-hidden-size", type=int, help="an expert's inner width")
    moe.add_argument("--moe-router-topk", type=int, help="experts per token")
    moe.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
        help="how tokens reach their experts' ranks (CPU: allgather)",
    )
    moe.add_argument("--moe-aux-loss-coeff", type=float, help="load-balancing loss coefficient")
    moe.add_argument("--moe-z-loss-coeff", type=float, help="router z-loss coefficient")
    moe.add_argument(
        "--moe-router-load-balancing-type",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
        help="the load-balancing method",
    )
    moe.add_argument(
        "--moe-layer-freq", type=moe_layer_freq, help="N (an MoE layer every N) or a list like ([0]*1+[1]*3)"
    )
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, help="the shared expert's width")
    moe.add_argument("--moe-grouped-gemm", action="store_true", default=None, help="TE's grouped GEMM (GPU)")
    moe.add_argument("--expert-model-parallel-size", type=int, help="ranks the experts are split over (EP)")
    moe.add_argument("--expert-tensor-parallel-size", type=int, help="tensor-parallel ranks of an expert")
    moe.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        default=None,
        help="overlapped F&B pairs: one microbatch's expert all-to-all runs beside another's compute "
        "(DualPipe's point; EP > 1, alltoall dispatcher; docs/schedules.md)",
    )


def run(args: argparse.Namespace) -> int:
    """Read and check the settings here, then start the workers (torch and megatron-core are
    imported only now: ``train --help`` and a bad flag stay quick)."""
    from ..launcher_env import launcher_world
    from ..training.checks import check

    settings = load_settings(args)
    world = launcher_world()
    if (
        world is not None
        and args.dp is not None
        and world[1] != settings.tp * settings.cp * settings.pp * args.dp
    ):
        raise UsageError(
            "--data-parallel-size",
            f"the launcher started {world[1]} processes; DP under a launcher is world / (TP x CP x PP), "
            "drop --data-parallel-size",
        )
    settings = resolve_layout(settings, None if world is None else world[1])
    check(settings)
    from .. import launch  # torch and megatron-core: only for settings that passed
    from ..training.worker import fatal_message, worker

    world_size = settings.tp * settings.cp * settings.pp * settings.dp
    try:  # launch refuses more ranks than GPUs before it starts any (check_gpus)
        launch.run(
            worker, world_size, settings, grace_s=settings.timeout + 10, backend=settings.distributed_backend
        )
    except launch.LaunchError as error:
        layout = f"TP x CP x PP x DP = {settings.tp} x {settings.cp} x {settings.pp} x {settings.dp}"
        raise UsageError("--pipeline-model-parallel-size", f"{error} ({layout})") from None
    except launch.WorkerDied as error:
        raise JobError(fatal_message(settings, error, others="the other ranks stopped")) from None
    return 0


def settings_from_argv(argv: list[str], world_size: int | None = None) -> TrainSettings:
    """The checked settings of ``megatron-pp-ext train ARGV`` (``world_size``: as under a
    launcher of that many processes), for tests and scripts that call
    :func:`megatron_pp_ext.training.worker.train_loop`."""
    from ..training.checks import check

    parser = argparse.ArgumentParser(prog="megatron-pp-ext")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", *argv])
    settings = resolve_layout(load_settings(args), world_size)
    check(settings)
    return settings
