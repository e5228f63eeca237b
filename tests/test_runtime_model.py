"""Model chunks, SDPA attention, the B/W split and the memory probe, in one process.

Megatron needs torch.distributed and its parallel state even for one rank, so each check runs in
a one-rank gloo process (started through the forkserver of ``dist_utils``, a fraction of a
second each).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, rel_error, tiny_model


def _run(check: str, *args):
    return check_ok(run_ranks(model_worker, 1, check, *args, timeout=120))[0]


def model_worker(rank: int, world: int, check: str, *args):
    from megatron_pp_ext.megatron.model import init_parallel_state

    init_parallel_state(1)
    return CHECKS[check](*args)


# ---- checks (run inside the worker) ------------------------------------------------------------


def _attention_matches_naive() -> float:
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_pp_ext.megatron.attention import SDPAttention
    from megatron_pp_ext.megatron.model import transformer_config

    config = transformer_config(tiny_model(2))
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    s, b, heads, groups, d = 7, 2, config.num_attention_heads, config.num_query_groups, config.kv_channels
    q, k, v = torch.randn(s, b, heads, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    out = attention(q, k, v, None)
    # naive: repeat K/V per group, masked softmax
    k2, v2 = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k2) / d**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v2).reshape(s, b, heads * d)
    assert out.shape == (s, b, heads * d)
    # Megatron's causal mask (True = dropped) as the dataloader gives it: the causal kernel
    # runs as without it (is_causal; no s x s mask reaches SDPA)
    given = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    assert torch.equal(attention(q, k, v, given), out)
    return (out - expected).abs().max().item()


def _stages_match_reference(layers: list[int]) -> float:
    from megatron_pp_ext.megatron.model import (
        build_reference,
        build_stage,
        copy_from_reference,
        layer_offsets,
    )

    model = tiny_model(sum(layers))
    torch.manual_seed(0)
    reference = build_reference(model)
    offsets = layer_offsets(layers)
    stages = []
    for stage in range(len(layers)):
        chunk = build_stage(model, stage, layers)
        copy_from_reference(reference, chunk, offsets[stage])
        stages.append(chunk)
    batch = make_batches(model, 1)[0]
    expected = reference(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    hidden = None
    for chunk in stages:
        chunk.set_input_tensor(hidden)
        hidden = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return (hidden - expected).abs().max().item()


def _split_equals_fused(stage: int) -> dict:
    """One chunk: B then W gives the same gradients as BW; B defers one GEMM per linear."""
    from megatron_pp_ext.megatron.model import build_stage, split_layers
    from megatron_pp_ext.runtime.memory import ActivationMeter
    from megatron_pp_ext.runtime.stage import LossRecord, StageRunner
    from megatron_pp_ext.runtime.weight_grad import (
        DeferrableColumnParallelLinear,
        DeferrableRowParallelLinear,
        WeightGradStore,
    )

    model = tiny_model(4)
    layers = split_layers(model.num_layers, 3)
    torch.manual_seed(0)
    chunk = build_stage(model, stage, layers)
    batch = make_batches(model, 1)[0]
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    stage_input = None if stage == 0 else torch.randn(shape)
    output_grad = None if stage == 2 else torch.randn(shape)
    grads = {}
    for split in (False, True):
        chunk.zero_grad(set_to_none=True)
        store = WeightGradStore()
        runner = StageRunner(chunk, stage, 3, chunk.config, ActivationMeter(), store)
        runner.forward((0, 0), stage_input, forward_step, iter([batch]), 1, LossRecord())
        input_grad = runner.backward((0, 0), output_grad, split=split)
        if split:
            deferred = len(store._pending[(0, 0)])
            assert all(
                p.grad is None
                for m in chunk.modules()
                if isinstance(m, (DeferrableColumnParallelLinear, DeferrableRowParallelLinear))
                for p in m.parameters()
            ), "B must not touch weight gradients"
            runner.weight((0, 0))
            graph_grads = [n for n, p in chunk.named_parameters() if p.grad is not None and p.grad.grad_fn]
        grads[split] = ({n: p.grad.clone() for n, p in chunk.named_parameters()}, input_grad)
    linears = sum(
        isinstance(m, (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)) for m in chunk.modules()
    )
    errors = {n: rel_error(grads[True][0][n], grads[False][0][n]) for n in grads[False][0]}
    input_error = 0.0 if stage == 0 else rel_error(grads[True][1], grads[False][1])
    params = len(list(chunk.parameters()))
    return {
        "max_error": max(errors.values()),
        "input_error": input_error,
        "deferred": deferred,
        "linears": linears,
        "params": params,
        "pending": store.pending(),
        "graph_grads": graph_grads,
    }


def _op_memory() -> list[dict]:
    from megatron_pp_ext.megatron.model import build_stage, split_layers
    from megatron_pp_ext.runtime.memory import measure_op_memory

    model = tiny_model(4)
    layers = split_layers(model.num_layers, 3)
    batch = make_batches(model, 1)[0]
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    out = []
    for stage in range(3):
        chunk = build_stage(model, stage, layers)

        def run_forward(c, last=stage == 2):
            output, loss = forward_step(iter([batch]), c)
            return loss(output)[0] if last else output

        memory = measure_op_memory(chunk, run_forward, None if stage == 0 else torch.randn(shape))
        out.append(memory.__dict__)
    return out


def _stage_op_memory() -> list[dict]:
    from megatron_pp_ext.megatron.calibration import stage_op_memory

    model = tiny_model(6)
    return [m.__dict__ for m in stage_op_memory(model, 4, micro_batch_size=2, layers_per_stage=[1, 1, 2, 2])]


def _unsupported() -> list[str]:
    from megatron_pp_ext.megatron.model import ModelConfig, check_parallel_state, transformer_config

    messages = []
    for extra in ({"tensor_model_parallel_size": 2}, {"sequence_parallel": True}):
        try:
            transformer_config(ModelConfig(extra=extra))
        except ValueError as error:
            messages.append(str(error))
    try:
        check_parallel_state(2)
    except ValueError as error:
        messages.append(str(error))
    return messages


CHECKS = {
    "attention": _attention_matches_naive,
    "stages": _stages_match_reference,
    "split": _split_equals_fused,
    "memory": _op_memory,
    "unsupported": _unsupported,
    "stage_memory": _stage_op_memory,
}


# ---- tests -------------------------------------------------------------------------------------


def test_sdpa_attention_matches_naive_gqa() -> None:
    assert _run("attention") < 1e-5


@pytest.mark.parametrize("layers", [[1, 2, 1], [3, 1]])
def test_stage_chain_equals_reference(layers: list[int]) -> None:
    assert _run("stages", layers) == 0.0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_b_then_w_equals_bw(stage: int) -> None:
    result = _run("split", stage)
    assert result["max_error"] < 1e-6
    assert result["input_error"] < 1e-6
    assert result["deferred"] >= result["linears"]  # one GEMM per linear, plus uncovered params
    assert result["pending"] == []
    # W must not record autograd: a grad with a grad_fn keeps the GEMM inputs alive.
    assert result["graph_grads"] == []


def test_op_memory_probe() -> None:
    stages = _run("memory")
    for stage, memory in enumerate(stages):
        assert memory["forward"] > memory["after_backward"] > 0, (stage, memory)
        assert memory["after_weight"] == 0, (stage, memory)


def test_stage_op_memory_scales_with_layers() -> None:
    first, one, two, last = _run("stage_memory")
    for memory in (first, one, two, last):
        assert memory["forward"] > memory["after_backward"] > 0 and memory["after_weight"] == 0
    # a middle stage with two layers keeps twice what one layer keeps (same input stash aside)
    assert abs(two["after_backward"] - 2 * one["after_backward"]) < 0.01 * one["after_backward"]
    assert 1.8 < two["forward"] / one["forward"] < 2.05


def test_unsupported_parallelism_is_rejected() -> None:
    messages = _run("unsupported")
    assert len(messages) == 3
    assert "tensor_model_parallel_size=2" in messages[0]
    assert "sequence_parallel" in messages[1]
    assert "pipeline_model_parallel_size=2" in messages[2]


def test_split_layers_and_names() -> None:
    from megatron_pp_ext.megatron.model import layer_offsets, reference_name, split_layers

    assert split_layers(9, 4) == [2, 3, 2, 2]
    assert split_layers(5, 2) == [3, 2]
    assert split_layers(4, 2, [1, 3]) == [1, 3]
    assert layer_offsets([2, 3, 2, 2]) == [0, 2, 5, 7]
    assert (
        reference_name("decoder.layers.1.mlp.linear_fc1.weight", 5)
        == "decoder.layers.6.mlp.linear_fc1.weight"
    )
    assert reference_name("output_layer.weight", 5) == "output_layer.weight"
    with pytest.raises(ValueError, match="sums to"):
        split_layers(4, 2, [1, 2])
    assert split_layers(4, 3, [0, 4, 0]) == [0, 4, 0]  # the embedding, the loss alone (a layout's E|...|L)
    with pytest.raises(ValueError, match="except the first and the last"):
        split_layers(4, 3, [2, 0, 2])  # a middle stage would hold no parameter
    with pytest.raises(ValueError, match="at least one layer"):
        split_layers(3, 4)
