"""Model chunks from megatron-core: a tiny Llama-style GPT, cut into pipeline stages.

Each virtual stage is megatron-core's own ``GPTModel``: the first stage has the embedding, the
last has the final norm, the output layer and the loss; layer counts per stage may be uneven.
Each stage model is built as a self-contained GPTModel (its TransformerConfig has the stage's
layer count and ``pipeline_model_parallel_size=1``) so that any placement (interleaved, V-shape)
works without teaching Megatron's layer-offset arithmetic about it.

For exactness tests, :func:`build_reference` builds the whole model in one process and
:func:`copy_from_reference` copies its weights into a stage by global layer index;
:func:`reference_name` maps a stage parameter name back to the reference.

Tensor, sequence, context and data parallelism come from Megatron's own parallel state:
:func:`init_parallel_state` initialises it (TP, CP, PP = the pipeline size, DP = the rest of the
world), each stage's TransformerConfig takes its TP and CP sizes from it, and ``sequence_parallel``
comes with the model's ``extra`` fields. Under CP the chunks use the sliced core attention (it
attends across CP ranks) and rotary positions are cut by Megatron's load-balanced layout on any
device. :func:`check_parallel_state` refuses a state whose pipeline size is not the schedule's
(its data-parallel group would span our stages).
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from . import cpu_shim
from .layer_spec import block_spec, layer_spec, te_available, te_wgrad_refusal
from .model_config import ModelConfig, split_layers
from .rotary import DeviceRotaryEmbedding
from .sliced import enable_slicing


def moe_pattern(model: ModelConfig) -> list[int] | None:
    """Which layers of ``model`` are mixture-of-experts layers (1) and which dense (0), by global
    layer index, as megatron-core reads ``moe_layer_freq``: N is one MoE layer every N layers
    from layer 0, a list is the pattern itself. None for a model without experts."""
    if model.extra.get("num_moe_experts") is None:
        return None
    freq = model.extra.get("moe_layer_freq", 1)
    if isinstance(freq, int) and freq >= 1:
        return [1 if layer % freq == 0 else 0 for layer in range(model.num_layers)]
    if isinstance(freq, list) and len(freq) == model.num_layers and set(freq) <= {0, 1}:
        return list(freq)
    raise ValueError(
        f"moe_layer_freq={freq!r}: give a positive integer or a list of {model.num_layers} zeros "
        "(dense) and ones (MoE), one per layer"
    )


def transformer_config(
    model: ModelConfig, num_layers: int | None = None, layer_offset: int = 0
) -> TransformerConfig:
    """The megatron-core TransformerConfig of ``model`` (or of one stage with ``num_layers``
    whose first layer is global layer ``layer_offset``: its ``moe_layer_freq`` is its share of
    the model's pattern)."""
    fields = dict(
        num_layers=model.num_layers if num_layers is None else num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.hidden_size // model.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        params_dtype=model.torch_dtype,
        pipeline_dtype=model.torch_dtype,
        # Weights from one master tensor on the host, cut into this rank's TP shard, then moved
        # to the device (_gpt): the same weights whatever the layout, on CPU and on GPU (Megatron's
        # GPU initialisation draws each TP shard from its own stream of the CUDA RNG tracker)
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=_tensor_parallel_size(),
        context_parallel_size=_context_parallel_size(),
        pipeline_model_parallel_size=1,
        # a sent stage output's storage is freed (Megatron-LM sets it for every run)
        deallocate_pipeline_outputs=True,
    )
    fields.update(model.extra)
    pattern = moe_pattern(model)
    if pattern is not None and fields.get("moe_ffn_hidden_size") is None:
        fields["moe_ffn_hidden_size"] = model.ffn_hidden_size  # megatron-core's default, unwarned
    if pattern is not None:  # the stage's layers (a stage of no layer is built with one, dense)
        fields["moe_layer_freq"] = pattern[layer_offset : layer_offset + fields["num_layers"]] or [0]
    check_supported(SimpleNamespace(**fields))  # before Megatron's own, less specific, checks
    return TransformerConfig(**fields)


def _tensor_parallel_size() -> int:
    """This process's tensor-parallel size from Megatron's parallel state; 1 when it is not
    initialised (a single-process model)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def _context_parallel_size() -> int:
    """This process's context-parallel size from Megatron's parallel state (1 when it is not
    initialised). A model may ask for 1 (``extra``) in a CP world: it then runs every token."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def check_supported(config: Any) -> None:
    """Each stage is a GPTModel of Megatron's with ``pipeline_model_parallel_size=1`` (the
    runtime does the pipelining); its tensor-parallel size must be the parallel state's, sequence
    parallelism needs TP > 1, and its context-parallel size is the parallel state's or 1."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if tp != _tensor_parallel_size():
        raise ValueError(
            f"tensor_model_parallel_size={tp} but Megatron's parallel state has "
            f"TP={_tensor_parallel_size()}: initialise it with init_parallel_state(pp, tp={tp})"
        )
    for name, count in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", config.num_query_groups),
    ):
        if count % tp:
            raise ValueError(f"{name}={count} is not divisible by tensor_model_parallel_size={tp}")
    if getattr(config, "sequence_parallel", False) and tp == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
    _check_experts(config)
    cp = getattr(config, "context_parallel_size", 1)
    if cp not in (1, _context_parallel_size()):
        raise ValueError(
            f"context_parallel_size={cp} but Megatron's parallel state has CP={_context_parallel_size()}: "
            f"initialise it with init_parallel_state(pp, tp, cp={cp})"
        )


def _check_experts(config: Any) -> None:
    """A mixture-of-experts config megatron-core can build here: top-k within the experts, the
    experts split evenly over the parallel state's expert-parallel ranks, a token dispatcher
    and expert GEMMs that run on this device."""
    experts = getattr(config, "num_moe_experts", None)
    if experts is None:
        return
    topk = getattr(config, "moe_router_topk", 2)
    if not 1 <= topk <= experts:
        raise ValueError(f"moe_router_topk={topk} must be between 1 and num_moe_experts={experts}")
    ep = getattr(config, "expert_model_parallel_size", 1)
    state_ep = (
        parallel_state.get_expert_model_parallel_world_size()
        if parallel_state.model_parallel_is_initialized()
        else 1
    )
    if ep != state_ep:
        raise ValueError(
            f"expert_model_parallel_size={ep} but Megatron's parallel state has EP={state_ep}: "
            "initialise it with the same expert-parallel size"
        )
    if experts % ep:
        raise ValueError(f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}")
    refusal = experts_refusal_here(
        getattr(config, "moe_token_dispatcher_type", "allgather"), getattr(config, "moe_grouped_gemm", False)
    )
    if refusal is not None:
        raise ValueError(f"{refusal[0]}: {refusal[1]}")


def experts_refusal_here(dispatcher: str, grouped_gemm: bool) -> tuple[str, str] | None:
    """(flag, why) when this machine cannot run the experts asked for, else None: without CUDA,
    the flex dispatcher (DeepEP/HybridEP kernels) and TE's grouped GEMM. The allgather and
    alltoall dispatchers run on CPU (the alltoall one through ``cpu_shim``'s host stream)."""
    if torch.cuda.is_available():
        return None
    if dispatcher not in ("allgather", "alltoall"):
        return (
            "--moe-token-dispatcher-type",
            f"{dispatcher} needs GPUs (DeepEP/HybridEP): on CPU use alltoall",
        )
    if grouped_gemm:
        return ("--moe-grouped-gemm", "needs Transformer Engine's grouped GEMM on a GPU: drop it")
    return None


def layer_offsets(layers_per_stage: list[int]) -> list[int]:
    """Global index of the first layer of each stage."""
    offsets, total = [], 0
    for count in layers_per_stage:
        offsets.append(total)
        total += count
    return offsets


def defer_weight_gradients(config: TransformerConfig) -> None:
    """Have megatron-core's TE linears built with TE's deferred weight gradient (our W ops run
    ``backward_dw``, ``runtime/te_wgrad.py``). Set after the config's own checks:
    ``TransformerConfig`` accepts ``delay_wgrad_compute`` only with
    ``overlap_moe_expert_parallel_comm`` (its one user in megatron-core 0.16, the MoE EP-overlap
    schedule); the field is read only by the TE wrappers (at build and in ``backward_dw``) and by
    that schedule and CUDA-graph capture, which our chunks do not run. Refused, in one line, where
    the installed TE is older than the wrappers need."""
    refusal = te_wgrad_refusal("a B/W-split schedule")
    if refusal is not None:
        raise ValueError(refusal)
    config.delay_wgrad_compute = True


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _gpt(
    model: ModelConfig,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    use_te: bool | None,
    sliced: bool = False,
    defer_te_wgrad: bool = False,
    layer_offset: int = 0,
) -> GPTModel:
    # a stage of the embedding or the loss alone builds no layer; megatron-core's config takes
    # at least one (it scales the initial weights by it; ours are copied from the reference)
    config = transformer_config(model, max(1, num_layers), layer_offset)
    sliced = sliced or config.context_parallel_size > 1  # our sliced attention runs CP, sliced or not
    use_te = te_available() if use_te is None else use_te
    if config.num_moe_experts is not None:
        cpu_shim.bind_missing_te_general_gemm()
    if use_te and defer_te_wgrad:
        defer_weight_gradients(config)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(_layer_specs(config, num_layers, use_te, sliced), use_te),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
    )
    device = _device()
    if type(gpt.rotary_pos_emb) is RotaryEmbedding:
        gpt.rotary_pos_emb.__class__ = DeviceRotaryEmbedding  # same state, device-agnostic get_emb
        gpt.rotary_pos_emb.inv_freq = gpt.rotary_pos_emb.inv_freq.to(device)
        if config.context_parallel_size == 1:  # Megatron gives it the CP group whatever the config
            gpt.rotary_pos_emb.cp_group = None
    # Torch norms are created in the default dtype whatever params_dtype says.
    gpt = gpt.to(device=device, dtype=model.torch_dtype)
    if sliced:
        enable_slicing(gpt)
    return gpt


def _layer_specs(config: TransformerConfig, num_layers: int, use_te: bool, sliced: bool) -> list[Any]:
    """One spec per layer of the stage: dense, or MoE where its ``moe_layer_freq`` says 1."""
    dense = layer_spec(use_te, sliced)
    if config.num_moe_experts is None:
        return [dense] * num_layers
    moe = layer_spec(use_te, sliced, config.num_moe_experts, config.moe_grouped_gemm)
    return [moe if expert else dense for expert in config.moe_layer_freq[:num_layers]]


def build_stage(
    model: ModelConfig,
    stage: int,
    layers_per_stage: list[int],
    use_te: bool | None = None,
    sliced: bool = False,
    defer_te_wgrad: bool = False,
) -> GPTModel:
    """The GPTModel of virtual stage ``stage`` (embedding on stage 0, loss on the last).
    ``sliced``: sliced core attention and its SliceContext, for sequence-sliced schedules (always
    under context parallelism: that attention runs it, with one slice for unsliced schedules).
    ``defer_te_wgrad``: a schedule with a B/W split; Transformer Engine linears are then built
    with TE's deferred weight gradient (:func:`defer_weight_gradients`)."""
    last = len(layers_per_stage) - 1
    if not 0 <= stage <= last:
        raise ValueError(f"stage {stage} out of range 0..{last}")
    offset = sum(layers_per_stage[:stage])
    return _gpt(
        model, layers_per_stage[stage], stage == 0, stage == last, use_te, sliced, defer_te_wgrad, offset
    )


def build_chunks(
    model: ModelConfig,
    placement: Any,
    rank: int,
    layers_per_stage: list[int] | None = None,
    use_te: bool | None = None,
    sliced: bool = False,
    defer_te_wgrad: bool = False,
) -> list[GPTModel]:
    """This rank's model chunks under ``placement`` (a schedule's ``Placement``), in chunk order:
    the list the runtime and Megatron's ``model`` argument expect. ``sliced`` for schedules
    with sequence slices (a schedule's ``slices > 1``), ``defer_te_wgrad`` for those with a B/W
    split (a schedule's ``splits_backward``)."""
    layers = split_layers(model.num_layers, placement.num_stages, layers_per_stage)
    return [
        build_stage(model, stage, layers, use_te, sliced, defer_te_wgrad)
        for stage in placement.stages_of(rank)
    ]


def build_reference(model: ModelConfig, use_te: bool | None = None, sliced: bool = False) -> GPTModel:
    """The whole model in one GPTModel, without a pipeline and without context parallelism (every
    token in this process; same parameters as the chunks). Under expert parallelism it holds this
    rank's experts, each drawn as :func:`seed_experts` draws it."""
    alone = dataclasses.replace(model, extra={**model.extra, "context_parallel_size": 1})
    reference = _gpt(alone, model.num_layers, True, True, use_te, sliced)
    seed_experts(reference, model, torch.initial_seed())
    return reference


@torch.no_grad()
def seed_experts(gpt: GPTModel, model: ModelConfig, seed: int) -> None:
    """Give each routed expert weights from a generator of its own, keyed by (``seed``, layer,
    global expert index), cut to this rank's expert-TP shard: the same experts whatever the
    expert-parallel size. (megatron-core's CPU initialisation draws every rank's local experts
    from one stream, so under EP 2 expert 2 would repeat expert 0.) Normal with the model's
    standard deviation, the second linear scaled by 1/sqrt(2 x layers) as Megatron's output
    layers are."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if parallel_state.model_parallel_is_initialized():
        shard = parallel_state.get_expert_tensor_parallel_rank()
        shards = parallel_state.get_expert_tensor_parallel_world_size()
    else:
        shard, shards = 0, 1
    stds = (model.init_std, model.init_std / (2 * model.num_layers) ** 0.5)
    for layer_index, layer in enumerate(gpt.decoder.layers):
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, SequentialMLP):  # a dense layer (TE's grouped experts: not yet)
            continue
        for expert, local in zip(layer.mlp.local_expert_indices, experts.local_experts):
            # fc1 is column-parallel (output rows split over expert TP), fc2 row-parallel (inputs)
            for which, (linear, dim) in enumerate(((local.linear_fc1, 0), (local.linear_fc2, 1))):
                shape = list(linear.weight.shape)
                shape[dim] *= shards
                generator = torch.Generator().manual_seed(hash((seed, layer_index, expert, which)) % 2**62)
                full = torch.empty(shape).normal_(0.0, stds[which], generator=generator)
                linear.weight.copy_(full.chunk(shards, dim)[shard])


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def reference_name(stage_param_name: str, layer_offset: int) -> str:
    """``decoder.layers.1.x`` of a stage whose first layer is global layer 4 is ``decoder.layers.5.x``."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", stage_param_name)


@torch.no_grad()
def copy_from_reference(reference: torch.nn.Module, stage_model: torch.nn.Module, layer_offset: int) -> None:
    """Give ``stage_model`` the reference's weights, matched by global layer index."""
    ref = dict(reference.named_parameters())
    for name, param in stage_model.named_parameters():
        source = ref.get(reference_name(name, layer_offset))
        if source is None or source.shape != param.shape:
            raise KeyError(
                f"stage parameter {name} (layer offset {layer_offset}) has no reference counterpart"
            )
        param.copy_(source)


def build_chunks_from(
    reference: torch.nn.Module,
    model: ModelConfig,
    placement: Any,
    rank: int,
    layers_per_stage: list[int] | None = None,
    use_te: bool | None = None,
    sliced: bool = False,
    defer_te_wgrad: bool = False,
) -> tuple[list[GPTModel], dict[int, str]]:
    """This rank's chunks (as :func:`build_chunks`) with ``reference``'s weights, and, for each
    of their parameters (by ``id``), its name in the reference: the pipelined copy of one
    single-process model, whatever the placement."""
    offsets = layer_offsets(split_layers(model.num_layers, placement.num_stages, layers_per_stage))
    chunks = build_chunks(model, placement, rank, layers_per_stage, use_te, sliced, defer_te_wgrad)
    names: dict[int, str] = {}
    for stage, chunk in zip(placement.stages_of(rank), chunks):
        copy_from_reference(reference, chunk, offsets[stage])
        names.update({id(p): reference_name(n, offsets[stage]) for n, p in chunk.named_parameters()})
    return chunks, names


def seed_like_megatron(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed``: a seed of its own per pipeline stage (seed + 100 x
    pipeline rank) for Python's, NumPy's and torch's generators and, on CUDA, megatron-core's RNG
    tracker (``model_parallel_cuda_manual_seed``: the data-parallel stream and one per TP rank,
    which dropout in TP regions and Transformer Engine fork from; without it the first fork fails
    with "cuda rng state model-parallel-rng is not added"). On CPU the shim's tracker has no
    streams (``cpu_shim.py``). Parallel state must be initialised."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def init_parallel_state(
    pp_size: int, tp_size: int = 1, cp_size: int = 1, ep_size: int = 1, etp_size: int | None = None
) -> None:
    """Megatron's parallel state for our pipelines: TP = ``tp_size``, CP = ``cp_size``, PP =
    ``pp_size``, and data parallelism over the rest of the world (world = TP x CP x PP x DP,
    Megatron's rank order tp-cp-ep-dp-pp), so a data-parallel group never spans the stages of one
    pipeline; experts over ``ep_size`` ranks of a stage (expert TP ``etp_size``, default TP).
    ``torch.distributed`` must be initialised."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("init_parallel_state needs torch.distributed to be initialised first")
    if parallel_state.model_parallel_is_initialized():
        check_parallel_state(pp_size, tp_size, cp_size)
        return
    world = torch.distributed.get_world_size()
    if world % (tp_size * cp_size * pp_size):
        raise ValueError(
            f"world size {world} is not a multiple of tensor x context x pipeline parallel size "
            f"{tp_size} x {cp_size} x {pp_size}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=etp_size,
        create_gloo_process_groups=False,
    )
    check_parallel_state(pp_size, tp_size, cp_size)


def check_parallel_state(pp_size: int, tp_size: int | None = None, cp_size: int | None = None) -> None:
    """Refuse a parallel state with a pipeline size other than ours (its data-parallel group
    would all-reduce gradients across our stages), or another TP or CP size than asked for."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size is not None and tp != tp_size:
        raise ValueError(f"Megatron parallel state has TP={tp}, not the {tp_size} asked for")
    cp = parallel_state.get_context_parallel_world_size()
    if cp_size is not None and cp != cp_size:
        raise ValueError(f"Megatron parallel state has CP={cp}, not the {cp_size} asked for")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp != pp_size:
        raise ValueError(
            f"Megatron parallel state has pipeline size {pp} but the schedule has {pp_size} ranks: "
            "its data-parallel group would span pipeline stages; initialise it with "
            f"pipeline_model_parallel_size={pp_size}"
        )
