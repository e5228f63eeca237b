"""Transformer shapes (Llama-style decoder layers) and the per-layer counts derived from them.

The FLOP cost model (``flops.py``) and the computation-balanced sequence partition
(``partition.py``) both need the same two numbers per layer: the GEMM FLOPs per token and the
attention FLOPs per query-key pair. They live here, next to the shape, so both modules agree.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab) < 1:
            raise ValueError(f"model {self.name!r}: every size must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads")

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

    def layer_params(self) -> int:
        """GEMM weights of one layer (norm weights left out: they do no GEMM)."""
        h = self.hidden
        attention = h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        return attention + self.ffn_matrices * h * self.ffn

    def layer_linear_flops_per_token(self) -> int:
        """Forward GEMM FLOPs of one layer per token: 2 per multiply-add over every weight."""
        return 2 * self.layer_params()

    def attention_flops_per_pair(self) -> int:
        """Forward attention FLOPs per (query, key) pair per layer: a(4d+3) (QK^T and PV are 2d
        each per head; the 3 covers scale, exp and normalise of the softmax)."""
        return self.heads * (4 * self.head_dim + 3)

    def total_params(self) -> int:
        """All weights: layers (with their two norms), input embedding, final norm, output layer."""
        norms = 2 * self.hidden * self.layers + self.hidden
        return self.layers * self.layer_params() + norms + 2 * self.vocab * self.hidden


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
