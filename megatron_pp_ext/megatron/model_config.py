"""The model a config describes (``configs/*.yaml``'s model section, Megatron-LM's model flags):
plain data and its checks, without torch, so that bad input fails before torch is imported.
The megatron-core model built from it is megatron/model.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..schedule.memory_model import stage_layers
from ..schedule.models import ModelShape

if TYPE_CHECKING:
    import torch

BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}  # per element, by torch's dtype names


@dataclass(frozen=True)
class ModelConfig:
    """A tiny Llama-style model: RMSNorm, SwiGLU, rotary, no biases, untied output layer, GQA."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    seq_length: int = 32
    dtype: str = "float32"
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    # Architecture (configs/*.yaml; Megatron-LM's flags in brackets). The runtime's builder makes
    # the Llama-style defaults only (see ``unsupported``); the others serve pretrain_gpt.py,
    # ``simulate`` and the planner.
    normalization: str = "RMSNorm"  # or LayerNorm [--normalization]
    activation: str = "swiglu"  # or gelu [--swiglu]
    position_embedding: str = "rope"  # or learned_absolute [--position-embedding-type]
    max_position_embeddings: int | None = None  # None: seq_length; a limit for learned positions
    tied_embeddings: bool = False  # [no --untie-embeddings-and-output-weights]
    bias: bool = False  # linear-layer biases [no --disable-bias-linear]
    extra: dict = field(default_factory=dict)  # extra TransformerConfig fields

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size",
                     "vocab_size", "seq_length"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in BYTES:
            raise ValueError(f"dtype must be one of {sorted(BYTES)}, got {self.dtype!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads (GQA groups)")
        choices_of = {
            "normalization": ("RMSNorm", "LayerNorm"),
            "activation": ("swiglu", "gelu"),
            "position_embedding": ("rope", "learned_absolute"),
        }
        for name, choices in choices_of.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        head_size = self.hidden_size // self.num_attention_heads
        if self.position_embedding == "rope" and head_size % 2:
            raise ValueError(
                f"hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads} gives "
                f"heads of {head_size}: rotary embeddings rotate pairs, the head size must be even"
            )
        limit = self.max_position_embeddings
        if self.position_embedding == "learned_absolute" and limit is not None and self.seq_length > limit:
            raise ValueError(
                f"seq_length {self.seq_length} exceeds max_position_embeddings {limit}: learned "
                "absolute positions are a table of that many rows (a limit, unlike rope); raise "
                "max_position_embeddings to train a bigger table"
            )

    def unsupported(self) -> list[str]:
        """What of this architecture the runtime's builder cannot make (it builds Llama-style
        models: RMSNorm, SwiGLU, rotary positions, no biases, untied embeddings); [] if none."""
        llama = {
            "normalization": "RMSNorm",
            "activation": "swiglu",
            "position_embedding": "rope",
            "tied_embeddings": False,
            "bias": False,
        }
        as_yaml = {True: "true", False: "false"}
        return [
            f"{name}={as_yaml.get(getattr(self, name), getattr(self, name))}"
            for name, value in llama.items()
            if getattr(self, name) != value
        ]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: a config is read and checked before any process imports torch

        return getattr(torch, self.dtype)

    def shape(self) -> ModelShape:
        """The schedule core's ModelShape (FLOP model, balanced slice partition)."""
        return ModelShape(
            name="model",
            layers=self.num_layers,
            hidden=self.hidden_size,
            heads=self.num_attention_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            ffn=self.ffn_hidden_size,
            vocab=self.vocab_size,
            gated=self.activation == "swiglu",
            bytes_per_element=BYTES[self.dtype],
        )


def split_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
    """Layers per virtual stage. Given explicitly, it must sum to ``num_layers``, and only the first
    and last stage may hold none (a chunk of the embedding or the loss alone, as Megatron's layout
    "E|t*4|t*4|L" builds; a middle chunk without a layer would hold no parameter, which the runtime
    and DDP cannot run); by default an even split whose remainder goes to the middle stages (the
    ends carry embedding and loss)."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages:
            raise ValueError(f"layers_per_stage has {len(layers_per_stage)} entries for {num_stages} stages")
        if sum(layers_per_stage) != num_layers:
            raise ValueError(
                f"layers_per_stage {layers_per_stage} sums to {sum(layers_per_stage)}, not {num_layers}"
            )
        if min(layers_per_stage) < 0 or min(layers_per_stage[1:-1], default=1) < 1:
            raise ValueError(
                f"every stage needs a layer, except the first and the last (they hold the embedding "
                f"and the loss), got {layers_per_stage}"
            )
        return list(layers_per_stage)
    return stage_layers(num_layers, num_stages)  # the schedule core's rule, so its memory model agrees
