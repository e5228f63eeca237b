"""Megatron-LM's ``pretrain_gpt.py`` with our schedules: everything the patch in ``patches/`` calls.

The patch stays a few lines; the logic lives here:

* :func:`extra_args_provider` adds our ``--pp-*`` flags to Megatron's parser (chained with
  ModelOpt's provider when pretrain_gpt.py has one), and has the parser run :func:`check_args`
  on what it parsed: a bad combination ends there, the argparse way (usage, then
  ``pretrain_gpt.py: error: --flag: ...``, exit status 2), before torch.distributed starts.
* :func:`placed_model_provider` wraps pretrain_gpt's model provider: on its first call it checks
  Megatron's parsed arguments against the schedule (:func:`check_args`; what the parser could not
  check ends here in one line, exit status 2) and installs the hook; then it builds each chunk
  Megatron asks for (per ``vp_stage``) as the stage the schedule places there.
* :func:`layer_spec_for` is applied by ``gpt_builders.py`` to the layer spec it chose: sliced
  attention for ``--pp-seq-slices`` > 1 and for context parallelism on the local spec, deferrable
  linears for the B/W split on the local spec.
* :func:`needs_data` and :func:`full_batch` answer ``get_batch``'s and the dataset builder's
  "is this chunk a first or last stage?" for the schedule's placement.

Why the placement works inside Megatron's own model code: megatron-core derives a chunk's layer
offset and count, whether it has the embedding or the output layer, and Float16Module's fp32 cast
from the chunk's ``vp_stage`` and the rank its pipeline group reports, as stage = vp_stage x p +
rank. Every placement we generate keeps stage s in chunk s // p (V-shape puts stage 2p-1-r in
chunk 1 of rank r), so building chunk c with a pipeline group that reports rank s mod p (Megatron's
round-robin rank of stage s) makes megatron-core build exactly stage s, with the layer numbers,
checkpoint keys and pre/post processing of that stage. Nothing else of the group changes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ..schedule.ir import Placement
from ..schedule.layer_split import SplitError, check_layout_placement, megatron_args_split
from .hook import (
    Installed,
    OptionError,
    PipelineOptions,
    add_args,
    chunks_per_rank,
    install,
    num_microbatches,
)

# Megatron flags that drive machinery our runtime replaces: (attribute, flag, why).
REFUSED_FLAGS = (
    ("cpu_offloading", "--cpu-offloading", "use --pp-offload (PipeOffload) for activation offload"),
    (
        "fine_grained_activation_offloading",
        "--fine-grained-activation-offloading",
        "use --pp-offload (PipeOffload) for activation offload",
    ),
    (
        "delay_wgrad_compute",
        "--delay-wgrad-compute",
        "B/W-split schedules (zb-*, v-*, dualpipev) defer weight gradients themselves, on TE's spec too",
    ),
    ("use_torch_fsdp2", "--use-torch-fsdp2", "use Megatron's DDP (with --use-distributed-optimizer)"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "use Megatron's DDP (with --use-distributed-optimizer)"),
)


def extra_args_provider(*others: Callable[[argparse.ArgumentParser], Any] | None) -> Callable:
    """Megatron's ``extra_args_provider``: our flags, then each of ``others`` (None skipped)."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_args(parser)
        for other in others:
            if other is not None:
                parser = other(parser) or parser
        return checking_parser(parser)

    return provide


def checking_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with its ``parse_args`` and ``parse_known_args`` followed by
    :func:`check_parsed`: Megatron-LM's ``parse_args`` calls one of them before torch.distributed
    starts, so a bad combination of flags ends there as ``parser.error`` does (the usage line,
    ``pretrain_gpt.py: error: --flag: ...``, exit status 2, no traceback)."""
    depth = [0]  # argparse's parse_args calls parse_known_args: check once, in the outer call

    def checked(parse: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(parse)
        def run(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                parsed = parse(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                namespace = parsed[0] if isinstance(parsed, tuple) else parsed
                try:
                    build_schedule_chunks(namespace)
                    check_parsed(namespace)
                except OptionError as error:
                    parser.error(str(error))
            return parsed

        return run

    parser.parse_known_args = checked(parser.parse_known_args)  # type: ignore[method-assign]
    parser.parse_args = checked(parser.parse_args)  # type: ignore[method-assign]
    return parser


def build_schedule_chunks(namespace: argparse.Namespace) -> None:
    """Have Megatron build the model chunks the schedule runs, as train does: with ``--pp-chunks``,
    or a schedule that runs more than one chunk per rank by default (V-shape, interleaved), and no
    count of Megatron's own (``--num-virtual-stages-per-pipeline-rank``, the per-stage layer count
    or a layout), set ``--num-virtual-stages-per-pipeline-rank`` to it; so the same command line
    runs under train and pretrain_gpt.py."""
    from ..schedule.generators import SCHEDULES

    given = ("num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage")
    if any(getattr(namespace, name, None) is not None for name in given) or getattr(
        namespace, "pipeline_model_parallel_layout", None
    ):
        return
    if (getattr(namespace, "pipeline_model_parallel_size", 1) or 1) < 2 or not hasattr(namespace, given[0]):
        return  # one pipeline rank (Megatron takes no virtual stages there), or not Megatron-LM's parser
    spec = SCHEDULES.get(getattr(namespace, "pp_schedule", "1f1b"))
    chunks = getattr(namespace, "pp_chunks", None)
    if chunks is None:
        chunks = getattr(spec, "default_vpp", 1)  # an unknown schedule: check_args names it
    if chunks > 1:
        namespace.num_virtual_stages_per_pipeline_rank = chunks


def check_parsed(namespace: argparse.Namespace) -> None:
    """:func:`check_args` on the command line as Megatron-LM's ``validate_args`` will complete
    it (the data-parallel size from ``WORLD_SIZE``, the virtual pipeline size, defaults): run on
    a copy, its output silenced. Skipped where that is not yet known: a YAML config or
    ``--use-checkpoint-args`` (the arguments change later), or a command line Megatron refuses
    (its own check reports that); :func:`placed_model_provider` checks again at model build."""
    if getattr(namespace, "yaml_cfg", None) or getattr(namespace, "use_checkpoint_args", False):
        return
    args = copy.deepcopy(namespace)
    args.rank = int(os.getenv("RANK", "0"))  # as Megatron-LM's parse_args sets them after parsing
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    try:
        from megatron.training.arguments import validate_args

        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            validate_args(args, {})
    except Exception:  # not Megatron-LM's parser, or a command line it refuses: it says why later
        return
    check_args(args)


def _check_timeline_args(args: Any) -> None:
    """``--pp-timeline``: a .json file, and Megatron's profiling window inside the run (its files
    are written at the start of the step after the window)."""
    path = getattr(args, "pp_timeline", None)
    if not path:
        return
    from ..runtime.timeline import window_refusal

    start, end = getattr(args, "profile_step_start", 10), getattr(args, "profile_step_end", 12)
    refusal = window_refusal(path, start, end, getattr(args, "train_iters", None), written_after=True)
    if refusal is not None:
        flag, why = refusal
        raise OptionError(why, flag)


def _check_pairing_args(args: Any, chunks: int) -> None:
    """``--overlap-moe-expert-parallel-comm``: what the pairs need of the model
    (``runtime/expert_overlap.py``), and what megatron-core's TransformerConfig asserts for the
    flag (bf16 or fp16; a virtual pipeline size when PP > 1), named before any process builds."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return
    from types import SimpleNamespace

    from ..runtime.expert_overlap import FLAG, config_refusal

    fields = {name: getattr(args, name, None) for name in (
        "expert_model_parallel_size", "moe_token_dispatcher_type", "recompute_granularity",
        "recompute_method", "num_microbatches_with_partial_activation_checkpoints",
        "tensor_model_parallel_size", "context_parallel_size", "mtp_num_layers",
    )}  # fmt: skip
    why = config_refusal(SimpleNamespace(num_moe_experts=getattr(args, "num_experts", None), **fields), True)
    if why is None and not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        why = "megatron-core's TransformerConfig accepts it only with --bf16 or --fp16: add one"
    if why is None and args.pipeline_model_parallel_size > 1 and chunks < 2:
        why = (
            f"megatron-core's TransformerConfig asks for a virtual pipeline size with it when PP > 1: use a "
            f"schedule of two chunks per rank (dualpipev, v-zb, interleaved-1f1b), not --pp-schedule "
            f"{args.pp_schedule}"
        )
    if why is not None:
        raise OptionError(why, FLAG)


def check_args(args: Any) -> None:
    """Refuse Megatron arguments our schedule cannot run with; raise OptionError naming the flag."""
    for attribute, flag, instead in REFUSED_FLAGS:
        if getattr(args, attribute, False):
            raise OptionError(f"cannot combine with --pp-schedule {args.pp_schedule}: {instead}", flag)
    _check_vocab_args(args)
    pp = args.pipeline_model_parallel_size
    options = _with_megatron_chunks(PipelineOptions.from_args(args), args)
    try:
        schedule = options.schedule_for(pp, num_microbatches(args))
    except OptionError as error:
        if error.flag == "--pp-chunks" and args.pp_chunks is None:  # the count came from Megatron's flag
            megatron_flag = "--num-virtual-stages-per-pipeline-rank"
            raise OptionError(error.reason.replace("--pp-chunks", megatron_flag), megatron_flag) from None
        raise
    # Two different counts were refused by chunks_per_rank; left is a schedule of several chunks
    # where Megatron builds one (arguments it got after the parser: a YAML config, a checkpoint's).
    chunks = schedule.num_stages // pp
    megatron_chunks = args.virtual_pipeline_model_parallel_size or 1
    if chunks != megatron_chunks:
        raise OptionError(
            f"--pp-schedule {schedule.name} runs {chunks} model chunks per pipeline rank but Megatron "
            f"builds {megatron_chunks}: add --num-virtual-stages-per-pipeline-rank {chunks} "
            f"(or drop --pp-chunks)",
            "--num-virtual-stages-per-pipeline-rank",
        )
    placement = schedule.placement
    try:
        megatron_args_split(args, pp, chunks)  # megatron-core checks it only when it builds the model
        layout = getattr(args, "pipeline_model_parallel_layout", None) or None
        check_layout_placement(layout, schedule.name, placement)
    except SplitError as error:
        raise OptionError(str(error), error.flag) from None
    last_rank = placement.rank_of(placement.num_stages - 1)
    if last_rank != pp - 1 and not args.untie_embeddings_and_output_weights:
        raise OptionError(
            f"{schedule.name} puts the output layer on rank {last_rank}, next to the embedding, "
            "where Megatron's embedding group cannot tie them: add --untie-embeddings-and-output-weights",
            "--untie-embeddings-and-output-weights",
        )
    check_te_wgrad(args, schedule)
    _check_pairing_args(args, chunks)
    _check_timeline_args(args)
    if sliced_attention(args) and getattr(args, "create_attention_mask_in_dataloader", False):
        raise OptionError(
            "our sliced attention (sequence slices, context parallelism) is causal by construction: "
            "the dataloader's [seq, seq] mask is unused memory, and its tensor-parallel broadcast "
            "assumes whole sequences: add --no-create-attention-mask-in-dataloader",
            "--no-create-attention-mask-in-dataloader",
        )
    if schedule.slices > 1:
        from ..schedule.models import megatron_shape

        options.slice_lengths(schedule, args.seq_length, megatron_shape(args))


def defers_te_wgrad(args: Any, schedule: Any) -> bool:
    """A B/W-split schedule on the Transformer Engine spec: TE's linears then defer their weight
    gradients to our W ops (``runtime/te_wgrad.py``). False where TE does not import (Megatron
    reports that itself)."""
    import importlib.util

    return (
        schedule.splits_backward
        and args.transformer_impl == "transformer_engine"
        and importlib.util.find_spec("transformer_engine") is not None
    )


def check_te_wgrad(args: Any, schedule: Any) -> None:
    """A B/W-split schedule on the TE spec needs a TE that defers weight gradients (train's rule),
    and no Userbuffers TP overlap: TE asserts ``ub_bulk_wgrad`` off where it defers, and its
    deferred GEMM refuses Userbuffers."""
    if not defers_te_wgrad(args, schedule):
        return
    from .layer_spec import te_wgrad_refusal

    refusal = te_wgrad_refusal(schedule.name)
    if refusal is not None:
        raise OptionError(refusal, "--transformer-impl")
    if getattr(args, "tp_comm_overlap", False):
        raise OptionError(
            f"{schedule.name} defers weight gradients through Transformer Engine, which does not "
            "defer them under Userbuffers TP overlap: drop --tp-comm-overlap, or use "
            "--transformer-impl local",
            "--tp-comm-overlap",
        )


def _check_vocab_args(args: Any) -> None:
    """``--pp-vocab-parallel`` with what the model provider can build it with."""
    vocab = getattr(args, "pp_vocab_parallel", None) or "none"
    if vocab == "none":
        return
    refused = (
        (
            not args.untie_embeddings_and_output_weights,
            "tied embeddings: add --untie-embeddings-and-output-weights",
        ),
        (
            getattr(args, "position_embedding_type", "rope") == "learned_absolute",
            "learned absolute positions (their table stays on the first stage, untested): use "
            "--position-embedding-type rope",
        ),
    )
    for bad, why in refused:
        if bad:
            raise OptionError(f"{vocab} cannot run with {why}", "--pp-vocab-parallel")


# -- the hook, installed once per process from Megatron's arguments --------------------------------

_state: dict[str, Any] = {}


def setup(args: Any) -> Installed:
    """Check ``args`` and install the hook (once; later calls return it). Megatron's loss reading
    (``train_step``, ``evaluate``) is on the last pipeline rank, so the hook hands the loss dicts
    there whichever rank computes them."""
    hook = _state.get("hook")
    if hook is None or _state.get("args") is not args:
        check_args(args)
        if getattr(args, "num_experts", None):
            from .cpu_shim import bind_missing_te_general_gemm

            bind_missing_te_general_gemm()  # its router reads the name on installs without TE
        options = _with_megatron_chunks(PipelineOptions.from_args(args), args)
        hook = install(
            args,
            options=options,
            losses_on_last_rank=True,
            wrap_forward_step=functools.partial(slice_sequence_length, args),
        )
        _state.update(hook=hook, args=args)
    return hook


def placement(args: Any) -> Placement:
    return setup(args).schedule(args.pipeline_model_parallel_size, num_microbatches(args)).placement


def sliced(args: Any) -> bool:
    return (getattr(args, "pp_seq_slices", None) or 1) > 1


def sliced_attention(args: Any) -> bool:
    """Whether the chunks run our sliced core attention: for sequence slices, and under context
    parallelism on the local spec (it runs CP, the whole sequence as one slice). Unsliced
    schedules on the Transformer Engine spec keep TE's attention, which runs Megatron's own CP."""
    context_parallel = (getattr(args, "context_parallel_size", None) or 1) > 1
    return sliced(args) or (context_parallel and args.transformer_impl != "transformer_engine")


def slice_sequence_length(args: Any, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_step_func`` with ``args.seq_length`` set to the running slice's length while it
    runs. Megatron's ``get_batch_on_this_tp_rank`` receives the batch on tensor-parallel ranks > 0
    into buffers of ``args.seq_length`` tokens; a sliced schedule hands over one slice at a time."""
    from megatron.core.utils import unwrap_model

    from .sliced import slice_context_of

    @functools.wraps(forward_step_func)  # Megatron reads the signature (checkpointing argument)
    def forward_step(data_iterator: Any, model: Any, *rest: Any, **kwargs: Any) -> Any:
        context = slice_context_of(unwrap_model(model))
        if context is None or context.current is None:
            return forward_step_func(data_iterator, model, *rest, **kwargs)
        start, end = context.slice_bounds()
        whole, args.seq_length = args.seq_length, end - start
        try:
            return forward_step_func(data_iterator, model, *rest, **kwargs)
        finally:
            args.seq_length = whole

    return forward_step


# -- building the chunks ---------------------------------------------------------------------------


class StageRankGroup:
    """A pipeline process group that reports Megatron's round-robin rank of a chunk's stage.

    Only ``rank()`` differs from the real group; megatron-core reads it to place layers, the
    embedding and the output layer. Collectives are never run on it (the runtime has its own)."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def stage_of(chunk: int | None, args: Any = None) -> int:
    """The virtual stage the schedule runs in model chunk ``chunk`` (Megatron's vp_stage) here."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = args or get_args()
    layout = placement(args)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return layout.stages_of(rank)[chunk or 0]


def placed_model_provider(provider: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap pretrain_gpt's ``model_provider``: build each chunk as the stage the schedule puts
    there (see the module docstring), and give sliced chunks their slice context."""

    def build(
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        config: Any = None,
        pg_collection: Any = None,
    ) -> Any:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args

        from . import gloo_on_gpu

        gloo_on_gpu.install_where_needed()  # ranks sharing a GPU: Megatron's DDP through host memory
        args = get_args()
        layout = _placement_or_exit(args)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        rank = pg_collection.pp.rank()
        stage = layout.stages_of(rank)[vp_stage or 0]
        megatron_chunk, megatron_rank = divmod(stage, layout.pp)
        if megatron_chunk != (vp_stage or 0):
            raise ValueError(f"stage {stage} is not in Megatron's chunk {vp_stage} on rank {rank}")
        if megatron_rank != rank:
            pg_collection = copy.copy(pg_collection)
            pg_collection.pp = StageRankGroup(pg_collection.pp, megatron_rank)
        schedule = setup(args).schedule(args.pipeline_model_parallel_size, num_microbatches(args))
        if defers_te_wgrad(args, schedule):
            config = _deferring_config(args, config)
        with _final_norm_allowing_sequence_parallel():
            model = provider(
                pre_process=stage == 0,
                post_process=stage == layout.num_stages - 1,
                vp_stage=vp_stage,
                config=config,
                pg_collection=pg_collection,
            )
        if sliced_attention(args):
            from .sliced import enable_slicing

            enable_slicing(model)
        if (getattr(args, "pp_vocab_parallel", None) or "none") != "none":
            _place_vocabulary(model, vp_stage or 0, layout, args)
        return model

    return build


def _deferring_config(args: Any, config: Any) -> Any:
    """The config gpt_builder would build (or was given), with TE's deferred weight gradient
    on (``model.defer_weight_gradients``), so that its TE linears are built for our W ops."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.yaml_arguments import core_transformer_config_from_yaml

    from .model import defer_weight_gradients

    if config is None:
        if getattr(args, "yaml_cfg", None) is not None:
            config = core_transformer_config_from_yaml(args, "language_model")
        else:
            config = core_transformer_config_from_args(args)
    defer_weight_gradients(config)
    return config


def _placement_or_exit(args: Any) -> Placement:
    """:func:`placement`, or the end of the process in one line on stderr and exit status 2 when
    :func:`check_args` refuses what the parser could not check (every rank says it: the check
    depends on the arguments only). ``os._exit``: torch.distributed is up, and Python's exit
    would add its teardown warnings after the line."""
    try:
        return placement(args)
    except OptionError as error:
        sys.stdout.flush()
        print(
            f"{os.path.basename(sys.argv[0]) or 'pretrain_gpt.py'}: error: {error}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)


def _place_vocabulary(chunk: Any, chunk_index: int, layout: Placement, args: Any) -> None:
    """``--pp-vocab-parallel``, while Megatron's ``get_model`` builds this rank's chunks (before it
    wraps them in DDP, so the shard's parameters are chunk 0's like any other). Once this rank's
    chunks are built, :func:`setup_vocab_parallel` gives chunk 0 this rank's shard of Megatron's
    padded vocabulary and the first and last stages an embedding feed and an output capture in
    place of their full tables; the tables Megatron initialised (this TP rank's part) go from the
    first stage's rank and the last stage's to every pipeline rank, which keeps its rows: the
    shards start from the model a run without vocabulary parallelism starts from. The set-up is
    ``train``'s own (:func:`~megatron_pp_ext.megatron.vocabulary.shard_vocabulary`), with the
    tables broadcast instead of copied from a reference model."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .vocabulary import shard_vocabulary

    chunks = _state.setdefault("vocab_chunks", [])
    if chunk_index == 0:
        chunks.clear()
    chunks.append(chunk)
    if chunk_index < len(layout.stages_of(0)) - 1:
        return
    rank = parallel_state.get_pipeline_model_parallel_rank()
    stages = layout.stages_of(rank)
    last = layout.num_stages - 1
    weight = next(chunks[0].parameters())
    held = {  # Megatron's tables on this rank, taken before the feed and the capture drop them
        "embedding": chunks[layout.chunk_index(0)].embedding.word_embeddings.weight.detach()
        if 0 in stages
        else None,
        "output": chunks[layout.chunk_index(last)].output_layer.weight.detach() if last in stages else None,
    }

    def broadcast_tables() -> tuple[torch.Tensor, torch.Tensor]:
        """Each table from the rank that holds it (first stage's, last stage's) to every rank."""
        group = parallel_state.get_pipeline_model_parallel_group()
        rows = args.padded_vocab_size // parallel_state.get_tensor_model_parallel_world_size()
        tables = {}
        for name, source in (("embedding", 0), ("output", layout.rank_of(last))):
            table = held[name]
            if table is None:
                table = torch.empty(rows, args.hidden_size, dtype=weight.dtype, device=weight.device)
            table = table.contiguous()
            dist.broadcast(table, src=dist.get_global_rank(group, source), group=group)
            tables[name] = table
        return tables["embedding"], tables["output"]

    vocab = shard_vocabulary(
        chunks,
        layout,
        rank,
        args.padded_vocab_size,
        args.hidden_size,
        args.pp_vocab_parallel,
        sequence_parallel=bool(args.sequence_parallel),
        dtype=weight.dtype,
        device=weight.device,
        timeout_s=getattr(args, "pp_p2p_timeout", None),
        tables=broadcast_tables,
    )
    setup(args).vocab = vocab
    chunks.clear()


@contextlib.contextmanager
def _final_norm_allowing_sequence_parallel() -> Iterator[None]:
    """Given a layer spec (gpt_builders' local and TE specs), megatron-core builds a block's final
    norm from ``transformer_block.LayerNormImpl``; without Apex or TE that is WrappedTorchNorm,
    which refuses sequence parallelism. While a chunk is built it is our TorchNorm instead
    (:func:`adapt_layer_spec` swaps the layers' norms the same way)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .norm import TorchNorm

    if transformer_block.LayerNormImpl is not WrappedTorchNorm:
        yield
        return
    transformer_block.LayerNormImpl = TorchNorm
    try:
        yield
    finally:
        transformer_block.LayerNormImpl = WrappedTorchNorm


def layer_spec_for(spec: Any) -> Any:
    """The layer spec gpt_builders chose, made to run our schedules: sliced core attention where
    :func:`sliced_attention` says; on the local spec, deferrable linears (the B/W split), SDPA
    core attention (Megatron's local attention needs CUDA, and materialises the s x s scores on
    it) and a norm that allows
    sequence parallelism. A Transformer Engine spec keeps its TE modules. Unchanged when
    Megatron's arguments do not have our flags (another script sharing gpt_builders)."""
    from megatron.training import get_args

    args = get_args()
    if not hasattr(args, "pp_schedule"):
        return spec
    return adapt_layer_spec(spec, sliced=sliced_attention(args))


def adapt_layer_spec(spec: Any, sliced: bool) -> Any:
    """:func:`layer_spec_for` on an explicit ``sliced``; a block spec is adapted layer by layer."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from ..attention import SlicedCoreAttention
    from ..runtime.weight_grad import DeferrableColumnParallelLinear, DeferrableRowParallelLinear
    from .attention import SDPAttention
    from .norm import TorchNorm

    swaps = {
        ColumnParallelLinear: DeferrableColumnParallelLinear,
        RowParallelLinear: DeferrableRowParallelLinear,
        WrappedTorchNorm: TorchNorm,
        # fused attention on every device: Megatron's local attention needs CUDA and, on it,
        # materialises [b, heads, s, s]
        DotProductAttention: SDPAttention,
    }

    if isinstance(spec, TransformerBlockSubmodules):
        spec = copy.copy(spec)
        spec.layer_specs = [adapt_layer_spec(layer, sliced) for layer in spec.layer_specs]
        spec.layer_norm = swaps.get(spec.layer_norm, spec.layer_norm)
        return spec
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        module = getattr(layer, name, None)
        setattr(layer, name, swaps.get(module, module))
    attention = getattr(layer.self_attention, "submodules", None)
    if attention is not None:
        for name in ("linear_qkv", "linear_proj"):
            setattr(attention, name, swaps.get(getattr(attention, name), getattr(attention, name)))
        core = attention.core_attention
        attention.core_attention = SlicedCoreAttention if sliced else swaps.get(core, core)
    mlp = getattr(layer.mlp, "submodules", None)
    if mlp is not None and hasattr(mlp, "linear_fc1"):
        mlp.linear_fc1 = swaps.get(mlp.linear_fc1, mlp.linear_fc1)
        mlp.linear_fc2 = swaps.get(mlp.linear_fc2, mlp.linear_fc2)
    return spec


# -- data: which chunks read batches ---------------------------------------------------------------


def needs_data(vp_stage: int | None, megatron_answer: bool) -> bool:
    """Whether model chunk ``vp_stage`` reads tokens or labels: the schedule's first and last
    stage. ``megatron_answer`` (Megatron's rank-based check) stands when the hook is not set up."""
    if "hook" not in _state:
        return megatron_answer
    num_stages = placement(_state["args"]).num_stages
    return stage_of(vp_stage, _state["args"]) in (0, num_stages - 1)


def full_batch(vp_stage: int | None) -> bool:
    """Whether ``get_batch_on_this_tp_rank`` must broadcast the whole batch to the tensor-parallel
    ranks: Megatron broadcasts tokens to rank 0 and labels to rank p-1 only, but the schedule
    may put the last stage elsewhere (V-shape: on rank 0, with the first)."""
    if "hook" not in _state:
        return False
    from megatron.core import parallel_state

    args = _state["args"]
    stage = stage_of(vp_stage, args)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    last = placement(args).num_stages - 1
    return (stage == last and rank != args.pipeline_model_parallel_size - 1) or (stage == 0 and rank != 0)


# -- helpers ---------------------------------------------------------------------------------------


def _with_megatron_chunks(options: PipelineOptions, args: Any) -> PipelineOptions:
    """``--pp-chunks`` defaults to Megatron's ``--num-virtual-stages-per-pipeline-rank``."""
    import dataclasses

    chunks = chunks_per_rank(options.chunks, getattr(args, "virtual_pipeline_model_parallel_size", None))
    return dataclasses.replace(options, chunks=chunks)
