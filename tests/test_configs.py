"""configs/: the published Llama 2, Llama 3 and GPT-3 shapes, read by name by ``train``
(Llama-style ones; the others are refused with the architecture named), ``simulate --model`` and
scripts/slurm/launch.sh (``megatron_pp_ext.configs``), at sequence lengths from 4K to 512K."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json

import pytest
import yaml
from cli_runner import run_cli

from megatron_pp_ext import configs
from megatron_pp_ext.cli import main as cli_main

# name: (layers, hidden, heads, kv heads, ffn, vocab, rope base or None for learned positions,
#        published context, nominal size, exact count of the released weights or None)
PUBLISHED = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 10000, 4096, 7e9, 6_738_415_616),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 10000, 4096, 13e9, 13_015_864_320),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 10000, 4096, 70e9, 68_976_648_192),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 500000, 8192, 8e9, 8_030_261_248),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 500000, 8192, 70e9, 70_553_706_496),
    "gpt3-1.3b": (24, 2048, 16, 16, 8192, 50257, None, 2048, 1.3e9, None),
    "gpt3-175b": (96, 12288, 96, 96, 49152, 50257, None, 2048, 175e9, None),
}
LLAMA = [name for name in PUBLISHED if name.startswith("llama")]
GPT3 = [name for name in PUBLISHED if name.startswith("gpt3")]


def model_of(name: str) -> dict:
    return configs.model_section(configs.load(name))


def test_every_config_is_there_and_the_yaml_subset_reader_agrees() -> None:
    assert set(PUBLISHED) <= set(configs.names())
    for name in configs.names():
        text = configs.path_of(name).read_text()
        assert configs.parse_simple_yaml(text) == yaml.safe_load(text), name  # login nodes without PyYAML


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shape_and_parameter_count(name: str) -> None:
    layers, hidden, heads, groups, ffn, vocab, rope, context, nominal, exact = PUBLISHED[name]
    model = model_of(name)
    got = tuple(
        model[key]
        for key in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
        )
    )
    assert got == (layers, hidden, heads, groups, ffn, vocab)
    assert model["seq_length"] == context == model["max_position_embeddings"]
    if rope is None:  # GPT-3: LayerNorm, GeLU, learned positions, biases, tied embeddings
        assert (model["normalization"], model["activation"], model["position_embedding"]) == (
            "LayerNorm",
            "gelu",
            "learned_absolute",
        )
        assert model["bias"] and model["tied_embeddings"]
    else:  # Llama: RMSNorm, SwiGLU, rotary, no biases, untied
        assert (model["normalization"], model["activation"], model["position_embedding"]) == (
            "RMSNorm",
            "swiglu",
            "rope",
        )
        assert model["rotary_base"] == rope and not model["bias"] and not model["tied_embeddings"]
        assert model["norm_epsilon"] == 1e-5
    count = configs.parameter_count(model)
    assert abs(count / nominal - 1) < 0.04, f"{name}: {count / 1e9:.2f}B"
    if exact is not None:  # the released checkpoints' tensor sizes
        assert count == exact


def test_simulate_shape_matches_the_runtime_models_shape() -> None:
    from megatron_pp_ext.megatron.model import ModelConfig

    for name in PUBLISHED:
        runtime = ModelConfig(**configs.load(name)["model"]).shape()
        assert dataclasses.replace(runtime, name=name) == configs.shape(name)
        assert runtime.gated == (name in LLAMA)


def train_args(*argv: str) -> argparse.Namespace:
    from megatron_pp_ext.commands import train

    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


@pytest.mark.parametrize("name", PUBLISHED)
def test_train_loads_llama_configs_and_refuses_other_architectures(name: str) -> None:
    from megatron_pp_ext.errors import UsageError
    from megatron_pp_ext.training.checks import check
    from megatron_pp_ext.training.settings import load_settings, resolve_layout

    settings = resolve_layout(load_settings(train_args("--config", name)), None)
    training = configs.load(name)["training"]
    assert (settings.tp, settings.pp, settings.dp) == (training["tp"], training["pp"], training["dp"])
    if name in LLAMA:
        check(settings)
        return
    with pytest.raises(UsageError) as refused:
        check(settings)
    message = str(refused.value)
    assert refused.value.flag == "--config" and message.startswith("--config: ")
    assert "Llama-style" in message and "pretrain_gpt.py" in message and "simulate" in message
    assert "position_embedding=learned_absolute" in message and "tied_embeddings=true" in message


def test_train_overrides_take_a_big_config_down_to_size() -> None:
    from megatron_pp_ext.training.checks import check
    from megatron_pp_ext.training.settings import load_settings, resolve_layout

    args = train_args(
        "--config",
        "configs/llama3-8b.yaml",  # a path works as well as a name
        "--num-layers",
        "4",
        "--seq-length",
        "256",
        "--pipeline-model-parallel-size",
        "2",
        "--tensor-model-parallel-size",
        "1",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "1",
    )
    settings = resolve_layout(load_settings(args), None)
    check(settings)
    assert settings.model["num_layers"] == 4 and settings.model["seq_length"] == 256
    assert (settings.pp, settings.tp, settings.microbatches) == (2, 1, 4)
    assert settings.model["hidden_size"] == 4096 and settings.pipeline.schedule == "zb-h2"


def test_train_cli_refuses_gpt3_in_one_line() -> None:
    done = run_cli(["train", "--config", "gpt3-1.3b"], timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--config" in last and "Llama-style" in last and "train:" not in done.stdout


def test_model_config_checks_the_architecture_fields() -> None:
    from megatron_pp_ext.megatron.model import ModelConfig

    with pytest.raises(ValueError, match="activation must be one of"):
        ModelConfig(activation="relu")
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        ModelConfig(position_embedding="learned_absolute", max_position_embeddings=2048, seq_length=4096)
    assert ModelConfig(max_position_embeddings=4096, seq_length=524288).seq_length == 524288  # rope
    assert ModelConfig().unsupported() == []
    assert ModelConfig(bias=True, normalization="LayerNorm").unsupported() == [
        "normalization=LayerNorm",
        "bias=true",
    ]


@pytest.mark.parametrize("seq_length", [4096, 32768, 131072, 524288])
@pytest.mark.parametrize("name", PUBLISHED)
def test_sequence_lengths_from_4k_to_512k(name: str, seq_length: int) -> None:
    """Rotary configs take any length (max_position_embeddings follows it, the base stays the
    published one); learned positions are a table: longer is refused unless a bigger table is
    asked for."""
    model = model_of(name)
    rope = PUBLISHED[name][6]

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    if rope is not None:
        args = configs.megatron_args(model, seq_length)
        assert flag(args, "--seq-length") == str(seq_length)
        assert flag(args, "--max-position-embeddings") == str(
            max(seq_length, model["max_position_embeddings"])
        )
        assert flag(args, "--rotary-base") == str(rope)
        return
    if seq_length > model["max_position_embeddings"]:
        with pytest.raises(configs.ConfigError, match="learned position table") as refused:
            configs.megatron_args(model, seq_length)
        assert refused.value.flag == "--seq-length"
    args = configs.megatron_args(model, seq_length, max_position_embeddings=max(seq_length, 2048))
    assert flag(args, "--max-position-embeddings") == str(max(seq_length, 2048))
    assert flag(args, "--position-embedding-type") == "learned_absolute"


def simulate(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["simulate", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "name", list(PUBLISHED) + ["llama-7b", "gpt-1.3b", "tiny", "configs/llama2-70b.yaml"]
)
def test_simulate_takes_config_names_and_the_presets(name: str) -> None:
    code, out, err = simulate(
        "--model", name, "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--json"
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["makespan"] > 0 and len(result["peak_memory_bytes"]) == 4


def test_simulate_with_a_config_uses_its_shape_and_context() -> None:
    _, out, _ = simulate("--model", "gpt3-175b", "--pp", "8", "--microbatches", "8", "--json")
    default = json.loads(out)
    _, out, _ = simulate(
        "--model", "gpt3-175b", "--pp", "8", "--microbatches", "8", "--seq-length", "2048", "--json"
    )
    assert json.loads(out)["makespan"] == default["makespan"]  # the config's 2048 is the default
    code, _, err = simulate("--model", "gpt3-175b", "--seq-length", "8192")
    assert code == 2 and "--seq-length" in err and "learned position table of 2048" in err
    code, out, err = simulate(
        "--model", "llama2-70b", "--schedule", "slimpipe-interleaved", "--pp", "8", "--vpp", "10",
        "--slices", "8", "--microbatches", "8", "--seq-length", "131072", "--tensor-model-parallel-size",
        "8", "--sequence-parallel", "--data-parallel-size", "4", "--use-distributed-optimizer", "--json",
    )  # fmt: skip
    assert code == 0, err
    parts = json.loads(out)["memory_parts_bytes"]
    assert max(p["weights"] for p in parts) < 5 * 2**30  # 70B / (TP8 x PP8) in bf16


def test_simulate_names_the_choices_for_an_unknown_model() -> None:
    code, _, err = simulate("--model", "llama5-1t")
    assert code == 2
    assert "--model" in err and "llama2-70b" in err and "llama-7b" in err


def test_configs_command_line_for_the_launcher() -> None:
    from megatron_pp_ext.configs import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["shell", "llama2-70b", "--seq-length", "131072"]) == 0
    text = out.getvalue()
    assert "CFG_TP=8" in text and "CFG_PP_SCHEDULE=zb-h1" in text and "--seq-length 131072" in text
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["check", "gpt3-1.3b", "--pipeline-model-parallel-size", "2", "--microbatches", "4",
                     "--pp-schedule", "v-zb"]) == 2  # fmt: skip
    assert "ties its input and output embeddings" in err.getvalue()
