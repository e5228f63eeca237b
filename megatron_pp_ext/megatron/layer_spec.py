"""Transformer-layer specs for our model chunks.

The local spec is Megatron's own GPT layer (SelfAttention + MLP, pre-norm, RMSNorm) with three
substitutions: core attention on PyTorch SDPA (Megatron's local DotProductAttention needs CUDA),
Megatron's linears replaced by subclasses whose weight gradient can be deferred to a W op (the
B/W split; tensor and sequence parallel like Megatron's), and a torch norm that allows sequence
parallelism (``norm.py``). :func:`block_spec` adds the final norm of the same kind. On a GPU
with Transformer Engine importable, the TE spec is used instead; for a B/W split its linears are
built with TE's own deferred weight gradient (TE >= :data:`TE_WGRAD_VERSION`), which our W ops
drive (``runtime/te_wgrad.py``).
Sequence-sliced schedules (Seq1F1B, SlimPipe, sliced ZB/V-shape) take ``sliced=True``: the same
layer with SlicedCoreAttention as core attention.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from ..attention import SlicedCoreAttention
from ..runtime.weight_grad import DeferrableColumnParallelLinear, DeferrableRowParallelLinear
from .attention import SDPAttention
from .norm import TorchNorm


class SequentialExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP``, built without drawing from torch's global generator
    (``model.seed_experts`` then draws each expert from a generator of its own): how many experts
    a rank holds (EP) no longer shifts the draws of every weight built after them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with torch.random.fork_rng(devices=[]):
            super().__init__(*args, **kwargs)


class DeferrableLocalProvider(LocalSpecProvider):
    """Megatron's local backend with our deferrable linears, for its MoE spec builder: the
    experts (``SequentialMLP``) and the shared expert get linears whose weight gradient a W op
    can run."""

    def column_parallel_linear(self) -> type:
        return DeferrableColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return DeferrableRowParallelLinear

    def grouped_mlp_modules(
        self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool
    ) -> tuple[type, MLPSubmodules | None]:
        if moe_use_grouped_gemm:  # the legacy GroupedMLP: its weight gradients run inside B
            raise ValueError("moe_grouped_gemm needs Transformer Engine (TEGroupedMLP) on a GPU")
        return SequentialExperts, MLPSubmodules(
            linear_fc1=DeferrableColumnParallelLinear, linear_fc2=DeferrableRowParallelLinear
        )


def mlp_spec(num_experts: int | None = None) -> ModuleSpec:
    """The dense MLP, or with ``num_experts`` megatron-core's MoE layer (router, token
    dispatcher, ``SequentialMLP`` experts, shared expert) built by its own spec builder."""
    if num_experts is None:
        return ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(
                linear_fc1=DeferrableColumnParallelLinear, linear_fc2=DeferrableRowParallelLinear
            ),
        )
    return get_moe_module_spec_for_backend(DeferrableLocalProvider(), num_experts=num_experts)


def local_layer_spec(sliced: bool = False, num_experts: int | None = None) -> ModuleSpec:
    """Megatron's local GPT layer with SDPA core attention and deferrable linears; runs on CPU.
    ``sliced``: SlicedCoreAttention instead, for schedules that cut sequences into slices.
    ``num_experts``: a mixture-of-experts MLP (:func:`mlp_spec`)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=DeferrableColumnParallelLinear,
                    core_attention=SlicedCoreAttention if sliced else SDPAttention,
                    linear_proj=DeferrableRowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=mlp_spec(num_experts),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def te_available() -> bool:
    """True when Transformer Engine can be used: importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# TE's delay_wgrad_compute / backward_dw, which megatron-core's TE wrappers pass on from this version
TE_WGRAD_VERSION = "2.3.0"


def te_wgrad_refusal(schedule_name: str) -> str | None:
    """None when the installed Transformer Engine can defer weight gradients to W ops; else the
    one line that says which version ``schedule_name`` needs."""
    from megatron.core.utils import get_te_version, is_te_min_version

    if is_te_min_version(TE_WGRAD_VERSION):
        return None
    return (
        f"{schedule_name} defers weight gradients to W ops, which Transformer Engine does from "
        f"{TE_WGRAD_VERSION} (delay_wgrad_compute); this machine has {get_te_version()}: "
        f'pip install "transformer-engine[pytorch]>={TE_WGRAD_VERSION}", or use --transformer-impl local'
    )


def layer_spec(
    use_te: bool | None = None,
    sliced: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """The TE spec when ``use_te`` (default: when TE is available), else :func:`local_layer_spec`.
    ``sliced`` swaps core attention for SlicedCoreAttention (sequence-sliced schedules: it keeps
    the K/V of a microbatch's earlier slices); the model then needs ``enable_slicing``.
    ``num_experts`` (and on TE ``moe_grouped_gemm``): a mixture-of-experts MLP in every layer."""
    if use_te is None:
        use_te = te_available()
    if not use_te:
        if moe_grouped_gemm:
            raise ValueError("moe_grouped_gemm needs Transformer Engine (TEGroupedMLP) on a GPU")
        return local_layer_spec(sliced, num_experts)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm
    )
    if sliced:
        spec.submodules.self_attention.submodules.core_attention = SlicedCoreAttention
    return spec


def block_spec(specs: list[ModuleSpec], use_te: bool) -> TransformerBlockSubmodules:
    """The decoder block of these layers (one spec per layer: dense and MoE layers may mix; none
    for a stage of the embedding or the loss alone) with the final norm of their kind:
    :class:`TorchNorm` for the local spec (Megatron's default on CPU, ``WrappedTorchNorm``,
    refuses sequence parallelism), else megatron-core's ``LayerNormImpl`` (TENorm with
    Transformer Engine), as its block picks for a TE layer spec."""
    return TransformerBlockSubmodules(
        layer_specs=list(specs), layer_norm=LayerNormImpl if use_te else TorchNorm
    )
