"""The model to plan: a config (``configs/*.yaml``, by name or file) or a preset, with Megatron's
shape flags on top, so any published model can be planned from one command line."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .. import configs
from ..schedule.models import PRESETS, ModelShape

# Megatron flag -> (ModelShape field, config model-section key)
SHAPE_FLAGS = {
    "--num-layers": ("layers", "num_layers"),
    "--hidden-size": ("hidden", "hidden_size"),
    "--num-attention-heads": ("heads", "num_attention_heads"),
    "--num-query-groups": ("kv_heads", "num_kv_heads"),
    "--ffn-hidden-size": ("ffn", "ffn_hidden_size"),
    "--vocab-size": ("vocab", "vocab_size"),
}


class ModelError(ValueError):
    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass
class ModelSpec:
    """The shape to plan and how a launcher names it: ``config`` (a configs/ name or a YAML
    path) when there is one, the config's model section, and the shape flags given on top."""

    name: str
    shape: ModelShape
    config: str | None = None
    section: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)  # Megatron flag -> value

    def override_args(self) -> list[str]:
        args: list[str] = []
        for flag, value in self.overrides.items():
            if flag == "--swiglu":
                args.append("--swiglu")
            elif flag == "--num-query-groups":
                args += ["--group-query-attention", flag, str(value)]
            else:
                args += [flag, str(value)]
        return args

    def megatron_args(self, seq_length: int) -> list[str]:
        """Megatron-LM's model flags: the config's (``configs.megatron_args``), or a Llama-style
        description of the shape, then the overrides (argparse keeps the last value)."""
        section = dict(self.section)
        if not section:
            s = self.shape
            section = {
                "num_layers": s.layers,
                "hidden_size": s.hidden,
                "num_attention_heads": s.heads,
                "num_kv_heads": s.kv_heads,
                "ffn_hidden_size": s.ffn,
                "vocab_size": s.vocab,
                "activation": "swiglu" if s.gated else "gelu",
                "dtype": "bfloat16",
            }
        return configs.megatron_args(section, seq_length) + self.override_args()


def resolve(model: str, flags: dict[str, Any]) -> ModelSpec:
    """``model`` (config name, YAML file or preset) with ``flags`` (Megatron flag -> value, None
    when not given) applied. Raises ModelError naming the flag."""
    if model in PRESETS:
        spec = ModelSpec(name=model, shape=PRESETS[model])
    elif configs.exists(model):
        try:
            config = configs.load(model)
            section = configs.model_section(config)
            spec = ModelSpec(
                name=configs.short_name(model),
                shape=configs.shape(model, config),
                config=model,
                section=section,
            )
        except (configs.ConfigError, TypeError, ValueError, KeyError) as error:
            raise ModelError("--model", f"config {model!r}: {error}") from None
        if spec.shape.experts:  # until the planner's search and step model know expert parallelism
            raise ModelError(
                "--model",
                f"config {model!r}: a mixture-of-experts model ({spec.shape.experts} experts): plan "
                "does not model experts yet (it would plan a dense model); simulate --model and "
                "train run it",
            )
    else:
        choices = ", ".join([*configs.names(), *PRESETS])
        raise ModelError(
            "--model", f"unknown model {model!r}; choose a config or preset ({choices}) or a YAML file"
        )
    changes: dict[str, Any] = {}
    for flag, (attribute, _) in SHAPE_FLAGS.items():
        value = flags.get(flag)
        if value is not None:
            if value < 1:
                raise ModelError(flag, f"{flag} must be positive, got {value}")
            changes[attribute] = value
            spec.overrides[flag] = value
    if flags.get("--swiglu"):
        changes["gated"] = True
        spec.overrides["--swiglu"] = True
    if "hidden" in changes or "heads" in changes:
        hidden = changes.get("hidden", spec.shape.hidden)
        heads = changes.get("heads", spec.shape.heads)
        if hidden % heads:
            raise ModelError("--num-attention-heads", f"{heads} heads do not divide --hidden-size {hidden}")
        changes["head_dim"] = hidden // heads
    if "heads" in changes and "kv_heads" not in changes and spec.shape.kv_heads == spec.shape.heads:
        changes["kv_heads"] = changes["heads"]
    try:
        spec.shape = replace(spec.shape, **changes)
    except ValueError as error:
        raise ModelError("--num-query-groups", str(error)) from None
    return spec
