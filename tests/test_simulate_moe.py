"""Mixture-of-experts layers in the schedule core's FLOP and memory models and in ``simulate
--model``: hand-computed activated FLOPs, expert weights split by EP, the per-stage mix of MoE and
dense layers that ``moe_layer_freq`` gives, and the CLI (``plan`` for MoE: tests/test_plan_moe.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megatron_pp_ext import configs
from megatron_pp_ext.cli import main as cli_main
from megatron_pp_ext.schedule.flops import FlopCosts, layer_activation_parts
from megatron_pp_ext.schedule.ir import Op, OpKind, Placement
from megatron_pp_ext.schedule.memory_model import (
    ParallelError,
    Parallelism,
    check_parallel,
    rank_expert_params,
    rank_params,
    stage_layers,
    stage_moe_layers,
    static_memory,
)
from megatron_pp_ext.schedule.models import ModelShape
from megatron_pp_ext.schedule.partition import causal_pairs

# The dense shape of test_simulate_parallel (4 layers, h=8, a=4 heads of d=2, g=2 KV heads,
# SwiGLU f=16, V=256, bf16), and the same with MoE layers 0 and 2 (moe_layer_freq 2): E=4
# routed experts of width f_e=8, k=2 per token, a shared expert of width f_s=4.
DENSE = ModelShape("t", layers=4, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=16, vocab=256)
MOE = ModelShape(
    "t-moe", layers=4, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=16, vocab=256,
    experts=4, topk=2, expert_ffn=8, shared_expert_ffn=4, moe_layer_freq=2,
)  # fmt: skip
H, E, K, F, FE, FS = 8, 4, 2, 16, 8, 4
ATTENTION = H * (8 + 2 * 4) + 8 * H  # QKV (q width a*d = 8, K and V g*d = 4 each) + out projection
EXPERT = 3 * H * FE  # one SwiGLU expert: gate, up and down, h x f_e each
PP2 = Placement(pp=2, num_stages=2)


def test_moe_layer_flops_count_the_activated_experts_only() -> None:
    dense = 2 * (ATTENTION + 3 * H * F)  # 2 FLOPs per multiply-add over every weight
    router = H * E
    shared = 3 * H * FS
    moe = 2 * (ATTENTION + router + shared + K * EXPERT)  # k of the E experts, not all
    assert dense == 1152 and moe == 1408
    assert MOE.layer_linear_flops_per_token() == DENSE.layer_linear_flops_per_token() == dense
    assert MOE.moe_layer_linear_flops_per_token() == moe
    assert DENSE.as_dense() == DENSE and MOE.as_dense().experts == 0

    # One stage of MoE layers 0 and 1 and one of dense layers 2 and 3, 16 tokens, no output layer
    # cost in stage 0: F is the GEMMs plus attention, W the GEMMs, B the GEMMs plus 2x attention.
    costs = FlopCosts(
        ModelShape(**{**MOE.__dict__, "moe_layer_freq": (1, 1, 0, 0)}), seq_length=16, num_stages=2
    )
    attention = 4 * (4 * 2 + 3) * causal_pairs(16, 16)  # a(4d+3) per (query, key) pair
    first, last = Op(OpKind.F, 0, 0), Op(OpKind.F, 1, 0)
    assert costs.flops(first) == 2 * (16 * moe + attention)
    assert costs.flops(Op(OpKind.W, 0, 0)) == 2 * 16 * moe
    head = 2 * 16 * H * 256
    assert costs.flops(last) == 2 * (16 * dense + attention) + head


def test_capacity_factor_drops_or_pads_the_routed_copies() -> None:
    def copies(**fields: object) -> float:
        return ModelShape(**{**MOE.__dict__, **fields}).routed_copies

    assert copies() == 2
    assert copies(capacity_factor=0.5) == 1.0  # each expert keeps half of its k/E share
    assert copies(capacity_factor=1.5) == 2.0  # nothing dropped under balanced routing
    assert copies(capacity_factor=1.5, pad_to_capacity=True) == 3.0  # padded to the capacity


def test_expert_weights_split_by_ep_and_their_state_by_expert_dp() -> None:
    # rank 0 holds layers 0 (MoE) and 1 (dense), rank 1 layers 2 (MoE) and 3 (dense)
    norms = 2 * H
    moe_layer = ATTENTION + H * E + 3 * H * FS + norms  # attention, router, shared expert, norms
    dense_layer = ATTENTION + 3 * H * F + norms
    vocab = 256 * H
    assert rank_params(MOE, PP2, [2, 2]) == [
        moe_layer + dense_layer + vocab,
        moe_layer + dense_layer + vocab + H,
    ]
    assert rank_expert_params(MOE, PP2, [2, 2], Parallelism()) == [E * EXPERT, E * EXPERT]
    assert rank_expert_params(MOE, PP2, [2, 2], Parallelism(dp=2, ep=2)) == [E // 2 * EXPERT] * 2
    assert (
        rank_expert_params(MOE, PP2, [2, 2], Parallelism(tp=2, sp=True, ep=2, etp=2))
        == [E // 2 * EXPERT // 2] * 2
    )

    ep1 = static_memory(MOE, PP2, Parallelism(dp=2))
    ep2 = static_memory(MOE, PP2, Parallelism(dp=2, ep=2))
    for one, two in zip(ep1, ep2):
        expert_bytes = E * EXPERT * 2  # bf16 weights
        assert one.weights - two.weights == expert_bytes / 2  # EP 2 holds half the experts
        assert two.experts == one.experts / 2
        assert one.experts == E * EXPERT * (2 + 4 + 12)  # bf16 weight, fp32 main grad, Adam 12 B
    # The distributed optimizer shards dense state over DP x CP = 2 and expert state over the
    # expert DP group, TP x CP x DP / (EP x ETP): 2 with EP 1, 1 with EP 2.
    sharded1 = static_memory(MOE, PP2, Parallelism(dp=2, distributed_optimizer=True))
    sharded2 = static_memory(MOE, PP2, Parallelism(dp=2, ep=2, distributed_optimizer=True))
    dense_params = rank_params(MOE, PP2, [2, 2])
    for rank in range(2):
        assert sharded1[rank].optimizer == dense_params[rank] * 12 / 2 + E * EXPERT * 12 / 2
        assert sharded2[rank].optimizer == dense_params[rank] * 12 / 2 + E // 2 * EXPERT * 12 / 1


def test_moe_activation_parts_by_hand() -> None:
    parts = layer_activation_parts(MOE, moe=True)
    # inside: Q,K,V 8+4+4, O 8, shared gate/up/down 3*4 -> 36 bf16 values + 4 fp32 lse
    # outside: 4 h-wide norm tensors 32 bf16 + 2 fp32 rstd + the router's softmax over E=4 in fp32
    # routed, per copy (k=2): the expert input h=8 in bf16 + its probability in fp32, and the
    # expert's gate/up/down 3*f_e = 24 bf16 values
    assert parts == (36 * 2 + 4 * 4, 32 * 2 + 2 * 4 + 4 * 4, K * (8 * 2 + 4), K * 24 * 2)
    assert parts.total == 88 + 88 + 40 + 96
    assert Parallelism().activation(parts) == 312
    # TP 2 with SP splits the dense part; expert TP 2 (the default) holds its copies' inputs whole
    # and half of their intermediates; expert TP 1 holds half the copies whole
    assert Parallelism(tp=2, sp=True).activation(parts) == (88 + 88) / 2 + (40 * 2 + 96) / 2
    assert Parallelism(tp=2, sp=True, etp=1).activation(parts) == (88 + 88) / 2 + (40 + 96) / 2
    assert Parallelism(ep=2, dp=2).activation(parts) == 312  # EP swaps tokens, not their number


@pytest.mark.parametrize(
    ("freq", "layers", "split", "mix"),
    [
        (1, 8, [4, 4], [4, 4]),  # every layer (Mixtral)
        (2, 8, [2, 2, 2, 2], [1, 1, 1, 1]),  # layers 0, 2, 4, 6
        (3, 8, [2, 2, 2, 2], [1, 1, 0, 1]),  # layers 0 | 3 | - | 6
        (2, 9, stage_layers(9, 4), [1, 2, 1, 1]),  # [2, 3, 2, 2]: layers 0 | 2, 4 | 6 | 8
        ((0, 1, 1, 1, 1, 1, 1, 1), 8, [4, 4], [3, 4]),  # DeepSeek: the first layer dense
        ((0, 1, 1, 1, 1, 1, 1, 1), 8, [1, 2, 2, 3], [0, 2, 2, 3]),
    ],
)
def test_moe_layer_freq_gives_each_stage_its_mix(
    freq: int | tuple[int, ...], layers: int, split: list[int], mix: list[int]
) -> None:
    shape = ModelShape(**{**MOE.__dict__, "layers": layers, "moe_layer_freq": freq})
    assert stage_moe_layers(shape, split) == mix
    assert stage_moe_layers(DENSE, [2, 2]) == [0, 0]
    # the stages' activations follow their mix: an MoE layer saves more here than a dense one
    costs = FlopCosts(shape, 16, num_stages=len(split), layers_per_stage=split)
    per_layer = {moe: Parallelism().activation(layer_activation_parts(shape, moe)) for moe in (False, True)}
    for stage, (count, moe) in enumerate(zip(split, mix)):
        op = Op(OpKind.F, stage, 0)
        last = (stage == len(split) - 1) * (2 * H * 2 + 256 * 4)  # final-norm and output-layer input, logits
        assert costs.activation(op) == 16 * ((count - moe) * per_layer[False] + moe * per_layer[True] + last)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"topk": 5}, "moe_router_topk=5"),
        ({"moe_layer_freq": (1, 0)}, "moe_layer_freq"),
        ({"moe_layer_freq": (1, 2, 1, 1)}, "moe_layer_freq"),
        ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ],
)
def test_bad_moe_fields_are_refused(fields: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ModelShape(**{**MOE.__dict__, **fields})


@pytest.mark.parametrize(
    ("parallel", "flag"),
    [
        (Parallelism(dp=3, ep=3), "--expert-model-parallel-size"),  # 3 does not divide 4 experts
        (Parallelism(ep=2), "--expert-model-parallel-size"),  # 1 rank per stage
        (Parallelism(dp=2, ep=2, etp=2), "--expert-model-parallel-size"),  # EP x ETP = 4 > 2
        (Parallelism(dp=16, etp=16), "--expert-tensor-parallel-size"),  # f_e = 8
        (Parallelism(tp=2, dp=2, ep=2), "--sequence-parallel"),
    ],
)
def test_expert_layouts_megatron_refuses(parallel: Parallelism, flag: str) -> None:
    with pytest.raises(ParallelError) as error:
        check_parallel(MOE, 64, parallel)
    assert error.value.flag == flag and flag in str(error.value)


def test_accepted_expert_layouts_and_dense_models_refuse_ep() -> None:
    check_parallel(MOE, 64, Parallelism(tp=2, sp=True, dp=2, ep=4, etp=1, distributed_optimizer=True))
    check_parallel(MOE, 64, Parallelism(tp=2, sp=True, cp=2, ep=2, distributed_optimizer=True))
    with pytest.raises(ParallelError) as error:
        check_parallel(DENSE, 64, Parallelism(dp=2, ep=2))
    assert error.value.flag == "--expert-model-parallel-size"


def test_configs_feed_the_moe_fields() -> None:
    mixtral, deepseek = configs.shape("tiny-mixtral"), configs.shape("tiny-deepseek")
    assert (mixtral.experts, mixtral.topk, mixtral.moe_ffn, mixtral.shared_expert_ffn) == (8, 2, 96, 0)
    assert all(mixtral.moe_layers())
    assert (deepseek.experts, deepseek.topk, deepseek.moe_ffn, deepseek.shared_expert_ffn) == (16, 4, 32, 64)
    assert deepseek.moe_layers() == (False,) + (True,) * 7
    assert configs.shape("llama2-7b").experts == 0
    # the launcher's Megatron-LM flags carry no experts: refused there, not launched dense
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        assert configs.main(["shell", "tiny-mixtral"]) == 2
    assert "mixture-of-experts" in err.getvalue()


# ---- the CLI -------------------------------------------------------------------------------


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("model", "schedule"), [("tiny-mixtral", "dualpipev"), ("tiny-deepseek", "zb-h1")])
def test_simulate_runs_the_moe_configs(model: str, schedule: str, tmp_path) -> None:
    code, out, err = cli(
        "simulate", "--model", model, "--schedule", schedule, "--pp", "2", "--microbatches", "8"
    )
    assert code == 0, err
    assert "memory per rank" in out and "experts)" in out and "NCCL" in out
    picture = tmp_path / "moe.svg"
    code, _, err = cli(
        "simulate", "--model", model, "--schedule", schedule, "--pp", "2", "--plot", str(picture)
    )
    assert code == 0 and picture.stat().st_size > 0, err


def test_simulate_ep2_holds_half_the_expert_memory() -> None:
    def parts(*extra: str) -> list[dict]:
        base = ["simulate", "--model", "tiny-mixtral", "--schedule", "1f1b", "--pp", "2", "--json"]
        code, out, err = cli(*base, "--data-parallel-size", "2", *extra)
        assert code == 0, err
        return json.loads(out)["memory_parts_bytes"]

    ep1, ep2 = parts(), parts("--expert-model-parallel-size", "2")
    shape = configs.shape("tiny-mixtral")
    for one, two in zip(ep1, ep2):
        assert two["experts"] == one["experts"] / 2
        half = shape.experts // 2 * shape.expert_params()  # the experts EP 2 leaves to its partner
        assert one["weights"] - two["weights"] == 4 * half * 4  # 4 MoE layers a rank, fp32
        assert one["activations"] == two["activations"]


def test_simulate_refuses_ep_not_dividing_the_experts_in_one_line() -> None:
    code, out, err = cli(
        "simulate", "--model", "tiny-mixtral", "--pp", "2", "--data-parallel-size", "3",
        "--expert-model-parallel-size", "3",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--expert-model-parallel-size" in err
    code, _, err = cli("simulate", "--expert-model-parallel-size", "2")
    assert code == 2 and "--model" in err


# ---- the expert all-to-all (issue #46) -----------------------------------------------------


def test_expert_all_to_all_of_an_op_by_hand() -> None:
    """Per MoE layer two all-to-alls a forward (dispatch, combine) and two a backward, each the
    rank's tokens x k copies x h x 2 bytes (bf16) x (EP-1)/EP, at the EP bandwidth."""
    # stage 0 holds layers 0 (MoE) and 1, stage 1 layers 2 (MoE) and 3: one MoE layer each
    costs = FlopCosts(MOE, seq_length=16, num_stages=2, parallel=Parallelism(dp=2, ep=2), ep_bandwidth=512.0)
    forward = Op(OpKind.F, 0, 0)
    one = 16 * K * H * 2 * (2 - 1) / 2  # 16 tokens, 2 copies, h = 8, bf16, half leave the rank
    assert one == 256 and costs.expert_alltoall_bytes(forward) == one
    assert costs.expert_comm_time(forward) == 2 * one / 512.0 == 1.0
    for kind in (OpKind.B, OpKind.BW):
        assert costs.expert_comm_time(Op(kind, 1, 3)) == 1.0
    compute = costs.flops(forward) / (costs.peak_flops * costs.utilisation)
    assert costs.duration(forward) == compute + 1.0  # exposed unless a pair hides it

    # b = 2 sequences, TP 2 with SP and CP 2 cut them to 2 x 16 / 4 = 8 tokens a rank; EP 4
    # keeps 1/4 of the copies local; a slice of 12 tokens of 16 sends 12/16 of that
    parallel = Parallelism(tp=2, sp=True, cp=2, ep=4, etp=1)
    sharded = FlopCosts(MOE, 16, num_stages=2, micro_batch_size=2, parallel=parallel, ep_bandwidth=1.0)
    assert sharded.expert_comm_time(forward) == 2 * (8 * K * H * 2 * 3 / 4) == 384
    sliced = FlopCosts(
        MOE, 16, 2, micro_batch_size=2, slice_lengths=[4, 12], parallel=parallel, ep_bandwidth=1.0
    )
    assert sliced.expert_comm_time(Op(OpKind.F, 0, 0, 1)) == 384 * 12 / 16


def test_no_expert_all_to_all_for_ep_1_w_ops_dense_stages_and_dense_models() -> None:
    ep2 = Parallelism(dp=2, ep=2)
    costs = FlopCosts(ModelShape(**{**MOE.__dict__, "moe_layer_freq": (1, 1, 0, 0)}), 16, 2, parallel=ep2)
    assert costs.expert_comm_time(Op(OpKind.F, 0, 0)) > 0
    assert costs.expert_comm_time(Op(OpKind.W, 0, 0)) == 0  # weight gradients move no tokens
    assert costs.expert_comm_time(Op(OpKind.F, 1, 0)) == 0  # stage 1: layers 2 and 3, dense
    assert FlopCosts(MOE, 16, 2, parallel=Parallelism(dp=2)).expert_comm_time(Op(OpKind.F, 0, 0)) == 0
    dense = FlopCosts(DENSE, 16, 2, parallel=ep2)
    for kind in (OpKind.F, OpKind.B, OpKind.W, OpKind.BW):
        op = Op(kind, 0, 0)
        assert dense.expert_comm_time(op) == 0
        assert dense.duration(op) == dense.flops(op) / (dense.peak_flops * dense.utilisation)
    assert costs.ep_bandwidth == 50e9  # one 400 Gb/s NIC per GPU (DeepSeek-V3's cluster)
    with pytest.raises(ValueError, match="ep_bandwidth"):
        FlopCosts(MOE, 16, 2, ep_bandwidth=0.0)


DEEPSEEK = [
    "simulate", "--model", "deepseek-v3-like", "--schedule", "dualpipev", "--pp", "4",
    "--microbatches", "16", "--data-parallel-size", "64", "--json",
]  # fmt: skip


def test_deepseek_like_config_is_deepseek_v3_s_shape() -> None:
    shape = configs.shape("deepseek-v3-like")
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (61, 7168, 128, 129280)
    assert (shape.experts, shape.topk, shape.moe_ffn, shape.shared_expert_ffn) == (256, 8, 2048, 2048)
    assert shape.moe_layers() == (False,) * 3 + (True,) * 58
    assert abs(shape.total_params() / 671e9 - 1) < 0.01


def test_simulate_pairs_hide_the_flop_models_all_to_all_on_a_deepseek_like_model() -> None:
    """EP 64: every F and B of an MoE stage pays its all-to-all (less at a faster link, none at
    EP 1), and DualPipeV's pairs hide much of it: shorter than unpaired."""

    def report(*extra: str) -> dict:
        code, out, err = cli(*DEEPSEEK, *extra)
        assert code == 0, err
        return json.loads(out)

    ep64 = report("--expert-model-parallel-size", "64", "--overlap-moe-expert-parallel-comm")
    assert ep64["pairs"] > 0 and ep64["makespan"] < 0.9 * ep64["makespan_unpaired"], ep64
    faster = report("--expert-model-parallel-size", "64", "--pp-ep-bandwidth", "400")["makespan"]
    ep1 = report()
    assert ep1["makespan"] < faster < ep64["makespan_unpaired"]
    assert "pairs" not in ep1  # the JSON has them only when pairing was asked for


@pytest.mark.parametrize(
    "argv",
    [
        [*DEEPSEEK, "--pp-ep-bandwidth", "0"],
        [*DEEPSEEK, "--pp-ep-bandwidth", "-50"],
        [*DEEPSEEK, "--pp-ep-bandwidth", "nan"],
        ["simulate", "--pp-ep-bandwidth", "50"],  # the uniform model's is --pp-expert-comm
    ],
)
def test_simulate_refuses_a_bad_ep_bandwidth_in_one_line(argv: list[str]) -> None:
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--pp-ep-bandwidth" in err, err


def test_simulate_with_a_model_points_pp_expert_comm_to_the_ep_bandwidth() -> None:
    code, _, err = cli("simulate", "--model", "llama-7b", "--pp-expert-comm", "1")
    assert code == 2 and "--pp-expert-comm" in err and "--pp-ep-bandwidth" in err
