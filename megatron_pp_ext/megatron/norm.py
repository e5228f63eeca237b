"""A torch norm that also runs under sequence parallelism.

Megatron's local spec uses ``WrappedTorchNorm``, which refuses ``sequence_parallel``: under SP a
norm sees only this rank's share of the tokens, so its weight gradient is partial and must be
summed over the tensor-parallel group. ``finalize_model_grads`` does that sum for every parameter
marked ``sequence_parallel = True`` (as Megatron's fused and TE norms mark theirs); this norm marks
its parameters so and is otherwise ``torch.nn.RMSNorm`` / ``LayerNorm``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm:
    """``WrappedTorchNorm`` with sequence parallelism allowed (its parameters marked for the
    tensor-parallel all-reduce of their gradients)."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma)
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("TorchNorm: zero-centered gamma and memory-efficient norms are not supported")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"TorchNorm supports {sorted(kinds)}, not {config.normalization!r}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
