"""The model to plan: a config (``configs/*.yaml``, by name or file) or a preset, with Megatron's
shape flags on top, so any published model can be planned from one command line."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .. import configs
from ..schedule.models import PRESETS, ModelShape
from .megatron_args import ArgsError, moe_layer_freq

# Megatron flag -> (ModelShape field, config model-section key)
SHAPE_FLAGS = {
    "--num-layers": ("layers", "num_layers"),
    "--hidden-size": ("hidden", "hidden_size"),
    "--num-attention-heads": ("heads", "num_attention_heads"),
    "--num-query-groups": ("kv_heads", "num_kv_heads"),
    "--ffn-hidden-size": ("ffn", "ffn_hidden_size"),
    "--vocab-size": ("vocab", "vocab_size"),
}
# Megatron's mixture-of-experts shape flag -> ModelShape field (a config's model.extra keys)
MOE_FLAGS = {
    "--num-experts": "experts",
    "--moe-router-topk": "topk",
    "--moe-ffn-hidden-size": "expert_ffn",
    "--moe-shared-expert-intermediate-size": "shared_expert_ffn",
}
MOE_FREQ_FLAG = "--moe-layer-freq"


def expert_args(shape: ModelShape) -> list[str]:
    """Megatron-LM's flags for ``shape``'s experts (none for a dense shape)."""
    if not shape.experts:
        return []
    args = ["--num-experts", str(shape.experts), "--moe-router-topk", str(shape.topk), "--moe-grouped-gemm"]
    if shape.expert_ffn:
        args += ["--moe-ffn-hidden-size", str(shape.expert_ffn)]
    if shape.shared_expert_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(shape.shared_expert_ffn)]
    if shape.moe_layer_freq != 1:
        args += [MOE_FREQ_FLAG, freq_text(shape.moe_layer_freq)]
    if shape.router_groups:
        args += ["--moe-router-num-groups", str(shape.router_groups)]
        args += ["--moe-router-group-topk", str(shape.router_group_topk)]
    if shape.capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", f"{shape.capacity_factor:g}"]
        if shape.pad_to_capacity:
            args.append("--moe-pad-expert-input-to-capacity")
    return args


def freq_text(freq: int | tuple[int, ...]) -> str:
    """``--moe-layer-freq``'s text: N, or the pattern as runs (``([0]*3+[1]*58)``)."""
    if isinstance(freq, int):
        return str(freq)
    runs: list[list[int]] = []
    for flag in freq:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([int(flag), 1])
    return "(" + "+".join(f"[{flag}]*{count}" for flag, count in runs) + ")"


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
            elif flag in MOE_FLAGS or flag == MOE_FREQ_FLAG:
                continue  # in expert_args, from the shape
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
        s = self.shape
        channels = ["--kv-channels", str(s.head_dim)] if s.head_dim * s.heads != s.hidden else []
        return configs.megatron_args(section, seq_length) + self.override_args() + channels + expert_args(s)


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
    else:
        choices = ", ".join([*configs.names(), *PRESETS])
        raise ModelError(
            "--model", f"unknown model {model!r}; choose a config or preset ({choices}) or a YAML file"
        )
    changes: dict[str, Any] = {}
    if flags.get("--swiglu"):
        changes["gated"] = True
        spec.overrides["--swiglu"] = True
    attributes = {flag: attribute for flag, (attribute, _) in SHAPE_FLAGS.items()} | MOE_FLAGS
    for flag, attribute in attributes.items():
        value = flags.get(flag)
        if value is not None:
            if value < 1:
                raise ModelError(flag, f"{flag} must be positive, got {value}")
            changes[attribute] = value
            spec.overrides[flag] = value
    freq = flags.get(MOE_FREQ_FLAG)
    if freq is not None:
        try:
            changes["moe_layer_freq"] = moe_layer_freq(freq, changes.get("layers", spec.shape.layers))
        except ArgsError as error:
            raise ModelError(error.flag, str(error)) from None
        spec.overrides[MOE_FREQ_FLAG] = freq
    experts = changes.get("experts", spec.shape.experts)
    moe_given = [f for f in (*MOE_FLAGS, MOE_FREQ_FLAG) if flags.get(f) is not None and f != "--num-experts"]
    if moe_given and not experts:
        raise ModelError(moe_given[0], f"{moe_given[0]} needs --num-experts ({spec.name} is dense)")
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
        flag = "--moe-router-topk" if "moe" in str(error) else "--num-query-groups"
        raise ModelError(flag, str(error)) from None
    return spec
