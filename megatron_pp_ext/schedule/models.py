"""Transformer shapes (Llama-style decoder layers) and the per-layer counts derived from them.

The FLOP cost model (``flops.py``) and the computation-balanced sequence partition
(``partition.py``) both need the same two numbers per layer: the GEMM FLOPs per token and the
attention FLOPs per query-key pair. They live here, next to the shape, so both modules agree.

A mixture-of-experts shape (``experts`` > 0) replaces the MLP of the layers ``moe_layer_freq``
picks by a router, ``experts`` routed experts of width ``expert_ffn`` of which each token uses
``topk``, and an optional always-on shared expert: megatron-core's MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``kv_heads`` < ``heads`` is grouped-query attention (GQA);
    ``gated`` is a SwiGLU MLP (three h x f matrices) instead of a two-matrix GeLU MLP."""

    name: str
    layers: int
    hidden: int  # h
    heads: int  # a
    kv_heads: int  # g
    head_dim: int  # d
    ffn: int  # f
    vocab: int  # V
    gated: bool = True
    bytes_per_element: int = 2  # bf16 activations
    # Mixture of experts (megatron-core's fields); the defaults are a dense model.
    experts: int = 0  # E, routed experts per MoE layer (num_moe_experts); 0: dense
    topk: int = 2  # k, experts per token (moe_router_topk)
    expert_ffn: int = 0  # f_e, one routed expert's FFN width (moe_ffn_hidden_size); 0: ffn
    shared_expert_ffn: int = 0  # f_s, the shared expert's width (moe_shared_expert_intermediate_size)
    moe_layer_freq: int | tuple[int, ...] = 1  # one MoE layer every N from layer 0, or a 0/1 per layer
    capacity_factor: float | None = None  # moe_expert_capacity_factor; None: no token dropping
    pad_to_capacity: bool = False  # moe_pad_expert_input_to_capacity
    # node-limited routing: experts in ``router_groups`` groups, a token's top-k taken from its
    # best ``router_group_topk`` groups (moe_router_num_groups / moe_router_group_topk); 0: none
    router_groups: int = 0
    router_group_topk: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab) < 1:
            raise ValueError(f"model {self.name!r}: every size must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads")
        if self.experts:
            self._check_experts()

    def _check_experts(self) -> None:
        """The MoE fields megatron-core would accept (its names, so a config's key is found)."""
        name = f"model {self.name!r}"
        if self.experts < 0 or min(self.expert_ffn, self.shared_expert_ffn) < 0:
            raise ValueError(f"{name}: num_moe_experts and the expert widths must be positive")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(
                f"{name}: moe_router_topk={self.topk} must be 1 to num_moe_experts={self.experts}"
            )
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise ValueError(f"{name}: moe_layer_freq={freq} must be a positive integer")
        elif len(freq) != self.layers or not set(freq) <= {0, 1}:
            raise ValueError(
                f"{name}: moe_layer_freq={freq!r} must list {self.layers} zeros (dense) and ones (MoE)"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"{name}: moe_expert_capacity_factor={self.capacity_factor} must be positive")
        groups, chosen = self.router_groups, self.router_group_topk
        if groups or chosen:
            if groups < 1 or self.experts % groups or not 1 <= chosen <= groups:
                raise ValueError(
                    f"{name}: moe_router_num_groups={groups} must divide the {self.experts} experts and "
                    f"moe_router_group_topk={chosen} be 1 to it"
                )
            if chosen * self.experts // groups < self.topk:
                raise ValueError(
                    f"{name}: moe_router_group_topk={chosen} groups of {self.experts // groups} experts "
                    f"hold fewer than moe_router_topk={self.topk}"
                )

    @property
    def q_width(self) -> int:
        """Width of the query (and attention output) projection, a*d."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of one of K or V, g*d (smaller than h under GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2

    def attention_params(self) -> int:
        """GEMM weights of one layer's attention: QKV (GQA-sized K and V) and output projection."""
        return self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden

    def layer_params(self) -> int:
        """GEMM weights of one dense layer (norm weights left out: they do no GEMM)."""
        return self.attention_params() + self.ffn_matrices * self.hidden * self.ffn

    def layer_linear_flops_per_token(self) -> int:
        """Forward GEMM FLOPs of one dense layer per token: 2 per multiply-add over every weight."""
        return 2 * self.layer_params()

    # ---- mixture of experts ------------------------------------------------------------------

    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are MoE layers, as megatron-core reads ``moe_layer_freq``: N is layers
        0, N, 2N, ...; a list is the pattern itself. All False for a dense model."""
        if not self.experts:
            return (False,) * self.layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return tuple(layer % freq == 0 for layer in range(self.layers))
        return tuple(bool(flag) for flag in freq)

    @property
    def moe_ffn(self) -> int:
        """f_e: ``expert_ffn``, or the dense ``ffn`` as megatron-core defaults it."""
        return self.expert_ffn or self.ffn

    @property
    def routed_copies(self) -> float:
        """Expert inputs per token under balanced routing: k. A capacity factor c caps each
        expert at c x (its share k/E of the tokens), so c < 1 drops to c x k; padding to
        capacity makes every expert compute its full capacity, c x k."""
        if self.capacity_factor is None:
            return self.topk
        return self.topk * (self.capacity_factor if self.pad_to_capacity else min(self.capacity_factor, 1.0))

    def expert_params(self) -> int:
        """GEMM weights of one routed expert (an MLP of width f_e)."""
        return self.ffn_matrices * self.hidden * self.moe_ffn

    def router_params(self) -> int:
        """The router's h x E gate, replicated over tensor-parallel ranks."""
        return self.hidden * self.experts

    def shared_expert_params(self) -> int:
        """The always-on shared expert (an MLP of width f_s; 0 without one)."""
        return self.ffn_matrices * self.hidden * self.shared_expert_ffn

    def moe_layer_linear_flops_per_token(self) -> float:
        """Forward GEMM FLOPs of one MoE layer per token, counting what a token activates:
        attention, the router, the shared expert and k routed experts (not all E)."""
        activated = self.routed_copies * self.expert_params()
        return 2 * (self.attention_params() + self.router_params() + self.shared_expert_params() + activated)

    def as_dense(self) -> ModelShape:
        """This shape with the experts taken out (every layer the dense MLP of width ``ffn``):
        what the runtime's own shape (``megatron_shape``, ``ModelConfig.shape``) still is."""
        return replace(self, experts=0, expert_ffn=0, shared_expert_ffn=0, moe_layer_freq=1)

    def attention_flops_per_pair(self) -> int:
        """Forward attention FLOPs per (query, key) pair per layer: a(4d+3) (QK^T and PV are 2d
        each per head; the 3 covers scale, exp and normalise of the softmax)."""
        return self.heads * (4 * self.head_dim + 3)

    def total_params(self) -> int:
        """All weights: layers (with their two norms; MoE layers with every expert), input
        embedding, final norm, output layer."""
        norms = 2 * self.hidden * self.layers + self.hidden
        moe = sum(self.moe_layers())
        moe_layer = (
            self.attention_params()
            + self.router_params()
            + self.shared_expert_params()
            + self.experts * self.expert_params()
        )
        layers = (self.layers - moe) * self.layer_params() + moe * moe_layer
        return layers + norms + 2 * self.vocab * self.hidden

    def activated_params(self) -> int:
        """Weights one token passes through: :meth:`total_params` with each MoE layer's routed
        experts counted top-k times, not E (DeepSeek-V3's "37B activated" of 671B)."""
        moe = sum(self.moe_layers())
        return int(self.total_params() - moe * (self.experts - self.routed_copies) * self.expert_params())


def megatron_shape(config: Any, vocab_size: int = 1) -> ModelShape:
    """The shape of a megatron-core TransformerConfig or Megatron-LM's parsed args (same
    attribute names), for the FLOP-balanced slice partition: only the per-layer sizes matter
    there, so the vocabulary may be left out."""
    heads = config.num_attention_heads
    groups = getattr(config, "num_query_groups", None)
    if getattr(config, "group_query_attention", True) is False:
        groups = None  # Megatron-LM args keep a num_query_groups default that GQA off ignores
    return ModelShape(
        name="megatron",
        layers=max(1, int(getattr(config, "num_layers", None) or 1)),
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=groups or heads,
        head_dim=getattr(config, "kv_channels", None) or config.hidden_size // heads,
        ffn=getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size,
        vocab=max(1, vocab_size),
        gated=bool(getattr(config, "gated_linear_unit", False) or getattr(config, "swiglu", False)),
    )


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelShape("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
        ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("gpt-1.3b", 24, 2048, 16, 16, 128, 8192, 50304, gated=False),
        # A CPU test model: 8 layers split over p=4 with v=2, or p=2 with v=4; fp32 on CPU.
        ModelShape("tiny", 8, 64, 4, 2, 16, 176, 256, bytes_per_element=4),
    )
}


def get_model(name: str) -> ModelShape:
    """Preset by name. Raises KeyError whose message lists the valid names (for ``--model``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r} (--model); choose from: {', '.join(PRESETS)}") from None
