"""Model configurations by name (``configs/*.yaml``), for every entry point.

``train --config NAME`` reads them (its own loader), ``simulate --model NAME`` takes their
shape, and ``scripts/slurm/launch.sh`` turns one into Megatron-LM flags with

    python -m megatron_pp_ext.configs shell NAME [--seq-length S] [--max-position-embeddings M]
    python -m megatron_pp_ext.configs check NAME --pipeline-model-parallel-size P ...

A config has three sections: ``model`` (the shape and architecture, the fields of
``megatron_pp_ext.megatron.model_config.ModelConfig``), ``training`` (layout and optimizer: tp, pp, dp,
micro/global batch, lr, ...) and ``pipeline`` (schedule, chunks, slices). Pure Python, no torch:
it runs on a login node. PyYAML when installed, else a reader for the subset the configs use
(nested mappings of scalars), since a cluster's login node may lack PyYAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from .megatron.model_config import BYTES, ModelConfig
from .schedule.models import ModelShape

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

# The model section's defaults: ModelConfig's own (a Llama-style model; model_config.py is free of
# torch too). max_position_embeddings None: the sequence length.
MODEL_DEFAULTS: dict[str, Any] = {
    field.name: field.default for field in dataclasses.fields(ModelConfig) if field.name != "extra"
}


class ConfigError(ValueError):
    """A config that cannot be used as asked; ``flag`` names what to change."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.reason = message


def names() -> list[str]:
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def is_file_name(name: str) -> bool:
    """A path to a YAML file rather than a name in configs/ (names may hold dots: gpt3-1.3b)."""
    path = Path(name)
    return path.suffix in (".yaml", ".yml") or len(path.parts) > 1


def short_name(name: str) -> str:
    return Path(name).stem if is_file_name(name) else name


def path_of(name: str) -> Path:
    """``name`` as a file (``.yaml`` or with a directory) or as a name in configs/."""
    path = Path(name) if is_file_name(name) else CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("--config", f"no config {name!r} (a YAML file or one of: {', '.join(names())})")
    return path


def exists(name: str) -> bool:
    try:
        path_of(name)
    except ConfigError:
        return False
    return True


def load(name: str) -> dict[str, Any]:
    """The raw config (its three sections) of a name or file."""
    path = path_of(name)
    text = path.read_text()
    try:
        import yaml
    except ModuleNotFoundError:
        return parse_simple_yaml(text)
    return yaml.safe_load(text) or {}


def model_section(config: dict[str, Any]) -> dict[str, Any]:
    """The model section with ModelConfig's defaults filled in, for the FLOP and memory models
    (``extra``, megatron-core's own fields such as the experts', is left out: :func:`experts`)."""
    model = {**MODEL_DEFAULTS, **(config.get("model") or {})}
    model.pop("extra", None)
    return model


def experts(config: dict[str, Any]) -> dict[str, Any]:
    """ModelShape's mixture-of-experts fields from the model section's ``extra`` (megatron-core's
    TransformerConfig names and defaults); empty for a dense model."""
    extra = (config.get("model") or {}).get("extra") or {}
    if extra.get("num_moe_experts") is None:
        return {}
    freq = extra.get("moe_layer_freq", 1)
    padded = bool(extra.get("moe_pad_expert_input_to_capacity", False))
    return {
        "experts": extra["num_moe_experts"],
        "topk": extra.get("moe_router_topk", 2),
        "expert_ffn": extra.get("moe_ffn_hidden_size") or 0,
        "shared_expert_ffn": extra.get("moe_shared_expert_intermediate_size") or 0,
        "moe_layer_freq": tuple(freq) if isinstance(freq, list) else freq,
        "capacity_factor": extra.get("moe_expert_capacity_factor"),
        "pad_to_capacity": padded,
        "router_groups": extra.get("moe_router_num_groups") or 0,
        "router_group_topk": extra.get("moe_router_group_topk") or 0,
    }


def refuse_experts(config: dict[str, Any], command: str) -> None:
    """Megatron-LM's flags written here (:func:`megatron_args`) carry no experts: refuse a
    mixture-of-experts config rather than launch a dense model in its place."""
    count = ((config.get("model") or {}).get("extra") or {}).get("num_moe_experts")
    if count is not None:
        raise ConfigError(
            "--config",
            f"a mixture-of-experts model ({count} experts): {command} writes no Megatron-LM expert "
            "flags yet (it would launch a dense model); train --config runs it",
        )


def head_dim(config: dict[str, Any]) -> int:
    """Per-head width: the model section's ``extra.kv_channels`` (megatron-core's name, Qwen3's
    128 at hidden 2048 with 32 heads), or the hidden size over the heads."""
    model = model_section(config)
    extra = (config.get("model") or {}).get("extra") or {}
    return int(extra.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"])


def shape(name: str, config: dict[str, Any] | None = None) -> ModelShape:
    """The schedule core's ModelShape of config ``name`` (FLOP and memory models), with its
    experts when it has them."""
    config = load(name) if config is None else config
    model = model_section(config)
    return ModelShape(
        name=short_name(name),
        layers=model["num_layers"],
        hidden=model["hidden_size"],
        heads=model["num_attention_heads"],
        kv_heads=model["num_kv_heads"],
        head_dim=head_dim(config),
        ffn=model["ffn_hidden_size"],
        vocab=model["vocab_size"],
        gated=model["activation"] == "swiglu",
        bytes_per_element=BYTES.get(model["dtype"], 2),
        **experts(config),
    )


def parameter_count(model: dict[str, Any]) -> int:
    """Every weight of the model section: layers (attention, MLP, norms, biases), embeddings
    (tied or not), learned positions, final norm. Megatron's vocabulary padding left out."""
    m = {**MODEL_DEFAULTS, **model}
    h, a, g, f, v = (
        m["hidden_size"],
        m["num_attention_heads"],
        m["num_kv_heads"],
        m["ffn_hidden_size"],
        m["vocab_size"],
    )
    d = h // a
    gated = m["activation"] == "swiglu"
    attention = h * (a * d + 2 * g * d) + a * d * h
    mlp = (3 if gated else 2) * h * f
    norm = 2 * h if m["normalization"] == "LayerNorm" else h
    bias = (a * d + 2 * g * d + h + (2 * f if gated else f) + h) if m["bias"] else 0
    layer = attention + mlp + 2 * norm + bias
    embedding = v * h * (1 if m["tied_embeddings"] else 2)
    table = m["max_position_embeddings"] or m["seq_length"]
    positions = table * h if m["position_embedding"] == "learned_absolute" else 0
    return m["num_layers"] * layer + norm + embedding + positions


def max_positions(model: dict[str, Any], seq_length: int, override: int | None = None) -> int:
    """Megatron's ``--max-position-embeddings`` for ``seq_length``. Rotary positions are computed,
    so any length works (Megatron only asks for >= the sequence length); learned absolute
    positions are a table, so the config's value is a limit unless ``override`` asks for a bigger
    table."""
    configured = override or model.get("max_position_embeddings")
    if model.get("position_embedding", "rope") != "learned_absolute":
        return max(configured or seq_length, seq_length)
    limit = configured or seq_length
    if seq_length > limit:
        raise ConfigError(
            "--seq-length",
            f"{seq_length} tokens exceed the model's learned position table of {limit} "
            "(max_position_embeddings): learned absolute positions cannot go past it. Use at most "
            f"{limit}, or train a bigger table from scratch with --max-position-embeddings "
            f"{seq_length} (MAX_POSITION_EMBEDDINGS for scripts/slurm/launch.sh), which adds "
            f"{seq_length - limit} x hidden_size weights",
        )
    return limit


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) >= 1 else f"{value:g}"


def megatron_args(
    model: dict[str, Any],
    seq_length: int | None = None,
    max_position_embeddings: int | None = None,
    rotary_base: int | None = None,
) -> list[str]:
    """Megatron-LM's model flags (``pretrain_gpt.py``) for a model section, at ``seq_length``
    (default: the config's). Tokenizer and vocabulary flags are the launcher's (mock data or a
    real tokenizer)."""
    m = {**MODEL_DEFAULTS, **model}
    seq = seq_length or m["seq_length"]
    heads, groups = m["num_attention_heads"], m["num_kv_heads"]
    args = [
        "--num-layers", str(m["num_layers"]),
        "--hidden-size", str(m["hidden_size"]),
        "--ffn-hidden-size", str(m["ffn_hidden_size"]),
        "--num-attention-heads", str(heads),
    ]  # fmt: skip
    if groups != heads:
        args += ["--group-query-attention", "--num-query-groups", str(groups)]
    args += [
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(max_positions(m, seq, max_position_embeddings)),
    ]
    if m["position_embedding"] == "rope":
        args += [
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            str(int(rotary_base or m["rotary_base"])),
        ]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    args += ["--normalization", m["normalization"], "--norm-epsilon", _number(m["norm_epsilon"])]
    if m["activation"] == "swiglu":
        args.append("--swiglu")  # Megatron's default MLP is GeLU
    if not m["bias"]:
        args.append("--disable-bias-linear")
    if not m["tied_embeddings"]:
        args.append("--untie-embeddings-and-output-weights")
    args += [
        "--init-method-std",
        _number(m["init_std"]),
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
    ]
    args += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(m["dtype"], [])
    return args


# ---- the launcher's view: shell variables --------------------------------------------------------

TRAINING_VARIABLES = {  # training/pipeline key -> (shell variable, default)
    "tp": ("CFG_TP", 1),
    "pp": ("CFG_PP", 1),
    "cp": ("CFG_CP", 1),
    "dp": ("CFG_DP", 1),
    "sequence_parallel": ("CFG_SEQUENCE_PARALLEL", False),
    "micro_batch_size": ("CFG_MICRO_BATCH_SIZE", 1),
    "global_batch_size": ("CFG_GLOBAL_BATCH_SIZE", None),
    "use_distributed_optimizer": ("CFG_USE_DISTRIBUTED_OPTIMIZER", False),
    "overlap_grad_reduce": ("CFG_OVERLAP_GRAD_REDUCE", False),
    "iterations": ("CFG_TRAIN_ITERS", 100),
    "lr": ("CFG_LR", 3e-4),
    "min_lr": ("CFG_MIN_LR", 3e-5),
    "warmup": ("CFG_WARMUP_ITERS", 0),
    "weight_decay": ("CFG_WEIGHT_DECAY", 0.1),
    "clip_grad": ("CFG_CLIP_GRAD", 1.0),
    "seed": ("CFG_SEED", 1234),
    "log_interval": ("CFG_LOG_INTERVAL", 1),
}
PIPELINE_VARIABLES = {
    "schedule": ("CFG_PP_SCHEDULE", "1f1b"),
    "chunks": ("CFG_PP_CHUNKS", None),
    "slices": ("CFG_PP_SEQ_SLICES", 1),
    "slice_partition": ("CFG_PP_SLICE_PARTITION", None),
}


def _shell_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return "''"
    if isinstance(value, float):
        return _number(value)
    return shlex.quote(str(value))


def shell(
    name: str,
    seq_length: int | None = None,
    max_position_embeddings: int | None = None,
    rotary_base: int | None = None,
) -> str:
    """Bash assignments of the config (``CFG_*``; ``CFG_MODEL_ARGS`` is an array) for
    ``eval`` in scripts/slurm/launch.sh."""
    config = load(name)
    refuse_experts(config, "the launcher's shell")
    model = model_section(config)
    seq = seq_length or model["seq_length"]
    training = config.get("training") or {}
    pipeline = config.get("pipeline") or {}
    lines = [
        f"CFG_NAME={shlex.quote(short_name(name))}",
        f"CFG_SEQ_LENGTH={seq}",
        f"CFG_VOCAB_SIZE={model['vocab_size']}",
        f"CFG_DTYPE={model['dtype']}",
    ]
    args = megatron_args(model, seq, max_position_embeddings, rotary_base)  # checks the length
    table = max_positions(model, seq, max_position_embeddings)
    lines.append(f"CFG_PARAMETERS={parameter_count({**model, 'max_position_embeddings': table})}")
    for table, section in ((TRAINING_VARIABLES, training), (PIPELINE_VARIABLES, pipeline)):
        for key, (variable, default) in table.items():
            lines.append(f"{variable}={_shell_value(section.get(key, default))}")
    lines.append("CFG_MODEL_ARGS=(" + " ".join(shlex.quote(arg) for arg in args) + ")")
    return "\n".join(lines)


def check_layout(
    name: str,
    pp: int,
    microbatches: int,
    schedule: str,
    chunks: int | None,
    slices: int,
    slice_partition: str | None,
    seq_length: int,
) -> dict[str, Any]:
    """The schedule the hook will generate for this layout (and the cut of the sequence into
    slices), so a bad combination fails on the login node, not on 256 GPUs. Returns what the
    launcher needs (``LAYOUT_*``: chunks per rank, slices, slice lengths, whether backward is
    split into B and W); raises ConfigError naming Megatron's or the plugin's flag."""
    from .megatron.hook import MEGATRON_FLAGS, OptionError, PipelineOptions

    options = PipelineOptions(
        schedule=schedule, chunks=chunks, slices=slices, slice_partition=slice_partition
    )
    try:
        generated = options.schedule_for(pp, microbatches)
        lengths = (seq_length,)
        if generated.slices > 1:
            lengths = tuple(options.slice_lengths(generated, seq_length, shape(name), MEGATRON_FLAGS))
    except OptionError as error:
        raise ConfigError(error.flag, error.reason) from None
    placement = generated.placement
    last_rank = placement.rank_of(placement.num_stages - 1)
    if last_rank != pp - 1 and model_section(load(name))["tied_embeddings"]:
        raise ConfigError(
            "--pp-schedule",
            f"{schedule} puts the output layer on rank {last_rank}, next to the embedding, where "
            f"Megatron cannot tie them, and {short_name(name)} ties its input and output embeddings: "
            "use a schedule whose last stage is on the last rank (1f1b, zb-h1, slimpipe, ...)",
        )
    same = len(set(lengths)) == 1
    return {
        "LAYOUT_CHUNKS": generated.num_stages // pp,
        "LAYOUT_SLICES": generated.slices,
        "LAYOUT_SLICE_LENGTHS": str(lengths[0]) if same else f"[{' '.join(map(str, lengths))}]",
        "LAYOUT_SPLITS_BACKWARD": int(generated.splits_backward),
    }


# ---- a YAML reader for the configs' subset --------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(\d[\d_]*)?(\.\d*)?([eE][-+]?\d+)?")


def _scalar(text: str) -> Any:
    text = text.strip()
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):  # a flow list of scalars: [0, 1, 1]
        inner = text[1:-1].strip()
        return [_scalar(item) for item in inner.split(",")] if inner else []
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if any(c.isdigit() for c in text) and _NUMBER.fullmatch(text):
        return float(text)
    return text


def parse_simple_yaml(text: str) -> dict[str, Any]:
    """Nested mappings of scalars and flow lists of scalars (``key: value``, ``key: [0, 1]`` and
    ``key:`` opening a mapping, by indentation), ``#`` comments: what configs/*.yaml use.
    Anything else raises ValueError."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, colon, value = line.strip().partition(":")
        if not colon or not key or key.startswith("-"):
            raise ValueError(f"line {number}: not a 'key: value' line: {raw!r}")
        while indent <= stack[-1][0]:
            stack.pop()
        parent = stack[-1][1]
        if value.strip():
            parent[key.strip()] = _scalar(value)
        else:
            child: dict[str, Any] = {}
            parent[key.strip()] = child
            stack.append((indent, child))
    return root


# ---- command line (for the launch scripts) -------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pp_ext.configs", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the config names")
    for command in ("shell", "megatron-args", "params"):
        sub = commands.add_parser(command)
        sub.add_argument("config")
        sub.add_argument("--seq-length", type=int)
        sub.add_argument("--max-position-embeddings", type=int)
        sub.add_argument("--rotary-base", type=int)
    check = commands.add_parser("check", help="generate the schedule of a layout (fails naming the flag)")
    check.add_argument("config")
    check.add_argument("--pipeline-model-parallel-size", dest="pp", type=int, required=True)
    check.add_argument("--microbatches", type=int, required=True, help="per data-parallel rank")
    check.add_argument("--pp-schedule", default="1f1b")
    check.add_argument("--pp-chunks", type=int)
    check.add_argument("--pp-seq-slices", type=int, default=1)
    check.add_argument("--pp-slice-partition")
    check.add_argument("--seq-length", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print("\n".join(names()))
        elif args.command == "check":
            seq = args.seq_length or model_section(load(args.config))["seq_length"]
            layout = check_layout(
                args.config,
                args.pp,
                args.microbatches,
                args.pp_schedule,
                args.pp_chunks,
                args.pp_seq_slices,
                args.pp_slice_partition,
                seq,
            )
            print("\n".join(f"{key}={shlex.quote(str(value))}" for key, value in layout.items()))
        elif args.command == "shell":
            print(shell(args.config, args.seq_length, args.max_position_embeddings, args.rotary_base))
        else:
            config = load(args.config)
            refuse_experts(config, args.command)
            model = model_section(config)
            if args.command == "params":
                seq = args.seq_length or model["seq_length"]
                table = max_positions(model, seq, args.max_position_embeddings)
                print(parameter_count({**model, "max_position_embeddings": table}))
            else:
                extra = (args.max_position_embeddings, args.rotary_base)
                print(shlex.join(megatron_args(model, args.seq_length, *extra)))
    except ConfigError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
