"""The schedule core's copy of megatron-core's layer split (``schedule/layer_split.py``) against
megatron-core itself: the same layers on every virtual stage, and a refusal wherever megatron-core
refuses, over every combination of Megatron's split flags at small sizes."""

from __future__ import annotations

import itertools
import warnings

import pytest

from megatron_pp_ext.schedule.layer_split import (
    EMBEDDING_FLAG,
    FIRST_FLAG,
    LAST_FLAG,
    LAYOUT_FLAG,
    LayerSplitFlags,
    SplitError,
    megatron_stage_layers,
    parse_layout,
    split_flags,
    uneven_splits,
)

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig


def megatron_config(layers: int, pp: int, **split: object) -> TransformerConfig:
    """A small megatron-core config of ``layers`` over ``pp`` ranks with the given split fields."""
    return TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        **split,
    )


def megatron_split(layers: int, pp: int, vpp: int, flags: LayerSplitFlags) -> list[int] | None:
    """What megatron-core builds on each virtual stage (stage = chunk x pp + rank), None if it refuses."""
    try:
        config = megatron_config(
            layers,
            pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            num_layers_in_first_pipeline_stage=flags.first,
            num_layers_in_last_pipeline_stage=flags.last,
            account_for_embedding_in_pipeline_split=flags.embedding_in_split,
            account_for_loss_in_pipeline_split=flags.loss_in_split,
        )
        split = [
            get_num_layers_to_build(config, vp_stage=stage // pp if vpp > 1 else None, pp_rank=stage % pp)
            for stage in range(pp * vpp)
        ]
    except (AssertionError, ValueError):
        return None
    # its config check lets end counts above --num-layers through (-1 % 1 == 0): nothing builds
    return None if min(split) < 0 else split


def ours(layers: int, pp: int, vpp: int, flags: LayerSplitFlags) -> list[int] | None:
    try:
        return megatron_stage_layers(layers, pp, vpp, flags)
    except SplitError:
        return None


CASES = [
    (layers, pp, vpp, LayerSplitFlags(first, last, embedding, loss))
    for layers in (4, 6, 7, 8, 10, 12)
    for pp in (2, 3, 4)
    for vpp in (1, 2, 3)
    for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2)
    for embedding, loss in itertools.product((False, True), repeat=2)
]


def test_every_flag_combination_splits_as_megatron_core() -> None:
    agreed = refused = 0
    for layers, pp, vpp, flags in CASES:
        expected = megatron_split(layers, pp, vpp, flags)
        assert ours(layers, pp, vpp, flags) == expected, (layers, pp, vpp, flags)
        agreed += expected is not None
        refused += expected is None
    assert agreed > 200 and refused > 200  # both outcomes well covered


@pytest.mark.parametrize(
    "text",
    ["Ettt|(tt|)*29,m|L", "E|(t|)*3,t|L", "Et*3|t*2,tL", "(Et|)*1,tt|tL", "E,t,t|t,t,L", "Et||tL"],
)
def test_layout_strings_parse_as_megatron_core(text: str) -> None:
    expected = PipelineParallelLayerLayout.parse_str_to_list(text)
    letters = {LayerType.embedding: "E", LayerType.loss: "L", LayerType.decoder: "t", LayerType.mtp: "m"}
    assert parse_layout(text) == ["".join(letters[layer] for layer in stage) for stage in expected]


@pytest.mark.parametrize(
    "text, layers, pp",
    [
        ("E|t*4|t*4|L", 8, 2),
        ("Ett|tt|tt|tL", 7, 2),
        ("Et|(tt|)*4,tL", 10, 3),
        ("Ettt|tttL", 6, 2),
        ("Et||t|L", 2, 2),
    ],
)
def test_layouts_split_as_megatron_core(text: str, layers: int, pp: int) -> None:
    stages = len(parse_layout(text))
    config = megatron_config(layers, pp, pipeline_model_parallel_layout=text)
    grid = config.pipeline_model_parallel_layout.layout  # [rank][chunk]
    expected = [grid[stage % pp][stage // pp].count(LayerType.decoder) for stage in range(stages)]
    assert megatron_stage_layers(layers, pp, stages // pp, LayerSplitFlags(layout=text)) == expected


@pytest.mark.parametrize(
    "text, layers, pp, vpp, words",
    [
        ("Ett|ttL", 5, 2, 1, "has 4 decoder layers"),
        ("Ett|tt|tL", 5, 2, 1, "not a multiple of --pipeline-model-parallel-size 2"),
        ("Ett|ttL", 4, 2, 2, "the run has 2"),
        ("tEt|ttL", 4, 2, 1, "E must be the first layer"),
        ("Ett|tLt", 4, 2, 1, "E must be the first layer and L the last"),
        ("Ett|Lt|tt|tL", 6, 2, 2, "the loss L must appear once"),
        ("Ett|tmL", 4, 2, 1, "multi-token prediction"),
        ("Etx|ttL", 4, 2, 1, "unknown layer letter 'x'"),
        ("|Ett|t|tL", 4, 2, 2, "the embedding E must appear once, in the first stage"),
    ],
)
def test_bad_layouts_are_refused_naming_the_flag(
    text: str, layers: int, pp: int, vpp: int, words: str
) -> None:
    with pytest.raises(SplitError, match=words) as caught:
        megatron_stage_layers(layers, pp, vpp, LayerSplitFlags(layout=text))
    assert caught.value.flag == LAYOUT_FLAG


def test_refusals_name_the_flag_to_change() -> None:
    with pytest.raises(SplitError, match="cannot share evenly") as caught:
        megatron_stage_layers(10, 4, 1, LayerSplitFlags(first=3))
    assert caught.value.flag == FIRST_FLAG
    with pytest.raises(SplitError, match="cannot be combined") as caught:
        megatron_stage_layers(10, 4, 1, LayerSplitFlags(first=1, embedding_in_split=True))
    assert caught.value.flag == EMBEDDING_FLAG
    with pytest.raises(SplitError, match="cannot be combined") as caught:
        megatron_stage_layers(10, 4, 1, LayerSplitFlags(first=1, layout="Et*5|t*5L"))
    assert caught.value.flag == LAYOUT_FLAG
    assert LayerSplitFlags().even and not LayerSplitFlags(loss_in_split=True).even


@pytest.mark.parametrize(
    "layers, pp, vpp, first_split",
    [
        (126, 16, 1, [7] + [8] * 14 + [7]),  # Llama 3 405B: the embedding and the loss counted as layers
        (61, 4, 1, [14, 16, 16, 15]),  # no account-for split divides: chosen end counts
        (30, 4, 2, [3, 4, 4, 4, 4, 4, 4, 3]),
        (80, 16, 1, None),  # divides evenly: nothing to choose
        (10, 16, 1, None),  # fewer layers than stages
    ],
)
def test_uneven_splits_are_megatron_s_and_balanced(
    layers: int, pp: int, vpp: int, first_split: list[int] | None
) -> None:
    """What the planner's free search may choose where an even split cannot: splits megatron-core
    itself builds, every virtual stage with a layer, the least loaded busiest rank first."""
    options = uneven_splits(layers, pp, vpp)
    if first_split is None:
        assert not options
        return
    assert megatron_stage_layers(layers, pp, vpp, options[0]) == first_split
    for flags in options:
        split = megatron_split(layers, pp, vpp, flags)
        assert split == megatron_stage_layers(layers, pp, vpp, flags) and min(split) >= 1
    assert len({tuple(megatron_stage_layers(layers, pp, vpp, f)) for f in options}) == len(options)
    assert split_flags(LayerSplitFlags(first=3, last=4)) == [FIRST_FLAG, "3", LAST_FLAG, "4"]
