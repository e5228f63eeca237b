"""Memory per rank under Megatron's TP/SP/CP/DP: hand-computed weights, gradients, optimizer state
and activation shards for a tiny shape, and the `simulate` flags that ask for them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule.flops import FlopCosts, layer_activation_parts
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Placement
from megatron_pp_ext.schedule.memory_model import (
    ParallelError,
    Parallelism,
    check_parallel,
    rank_params,
    stage_layers,
    static_memory,
)
from megatron_pp_ext.schedule.models import ModelShape
from megatron_pp_ext.schedule.simulate import simulate

# 4 layers, h=8, a=4 heads of d=2, g=2 KV heads, SwiGLU f=16, V=256, bf16.
# One layer's GEMM weights: QKV 8*(8+2*4)=128, out projection 8*8=64, MLP 3*8*16=384 -> 576;
# its two RMSNorm weights: 16. Embedding and output layer: 256*8 = 2048 each; final norm 8.
SHAPE = ModelShape("t", layers=4, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=16, vocab=256)
PP2 = Placement(pp=2, num_stages=2)


def test_stage_layers_follow_the_runtime_rule() -> None:
    assert stage_layers(9, 4) == [2, 3, 2, 2]  # the remainder goes to the middle stages
    assert stage_layers(5, 2) == [3, 2]
    assert stage_layers(10, 4) == [2, 3, 3, 2]
    assert stage_layers(32, 6) == [5, 6, 6, 5, 5, 5]
    with pytest.raises(ValueError):
        stage_layers(3, 4)


def test_weights_per_rank_by_hand() -> None:
    # rank 0: 2 layers + embedding; rank 1: 2 layers + final norm + output layer
    assert rank_params(SHAPE, PP2, [2, 2], tp=1) == [2 * (576 + 16) + 2048, 2 * (576 + 16) + 8 + 2048]
    # TP=2 halves the GEMM weights and the vocab-parallel embedding/output, not the norm weights
    assert rank_params(SHAPE, PP2, [2, 2], tp=2) == [2 * (288 + 16) + 1024, 2 * (288 + 16) + 8 + 1024]
    # V placement: rank 0 holds stages 0 and 3, so both the embedding and the output layer
    v_shape = Placement(pp=2, num_stages=4, style="vshape")
    assert rank_params(SHAPE, v_shape, [1, 1, 1, 1]) == [2 * 592 + 2 * 2048 + 8, 2 * 592]


def test_weights_gradients_and_optimizer_bytes() -> None:
    params = [3232, 3240]
    mixed = static_memory(SHAPE, PP2)
    assert [p.weights for p in mixed] == [2 * n for n in params]  # bf16 weights
    assert [p.gradients for p in mixed] == [4 * n for n in params]  # fp32 main_grad
    assert [p.optimizer for p in mixed] == [12 * n for n in params]  # fp32 master, m, v
    assert all(p.activations == 0 for p in mixed)
    fp32 = static_memory(SHAPE, PP2, param_bytes=4)
    assert [p.optimizer for p in fp32] == [8 * n for n in params]  # no master copy
    bf16_grads = static_memory(SHAPE, PP2, grad_bytes=2)
    assert [p.gradients for p in bf16_grads] == [2 * n for n in params]


def test_distributed_optimizer_shards_only_the_optimizer_state() -> None:
    plain = static_memory(SHAPE, PP2, Parallelism(dp=4))
    sharded = static_memory(SHAPE, PP2, Parallelism(dp=4, distributed_optimizer=True))
    for a, b in zip(plain, sharded):
        assert b.optimizer == a.optimizer / 4
        assert (b.weights, b.gradients) == (a.weights, a.gradients)
    # megatron-core builds the distributed optimizer on the DP x CP group
    with_cp = static_memory(SHAPE, PP2, Parallelism(dp=4, cp=2, distributed_optimizer=True))
    assert [p.optimizer for p in with_cp] == [a.optimizer / 8 for a in plain]


def test_activation_shards_per_token_by_hand() -> None:
    # inside the TP region: Q,K,V 8+4+4, O 8, gate/up/down 48 -> 72 bf16 values + 4 fp32 lse = 160 B
    # outside: 4 h-wide norm inputs/outputs 32 bf16 values + 2 fp32 rstd = 72 B
    parts = layer_activation_parts(SHAPE)
    assert (parts.inside, parts.outside) == (160, 72)
    assert Parallelism().activation(parts) == 232
    assert Parallelism(tp=2).activation(parts) == 80 + 72  # only the TP region is split
    assert Parallelism(tp=2, sp=True).activation(parts) == 232 / 2  # SP splits the rest too
    assert Parallelism(cp=2).activation(parts) == 232 / 2
    assert Parallelism(tp=2, sp=True, cp=2).activation(parts) == 232 / 4


def _peaks(parallel: Parallelism) -> list[float]:
    schedule = generate("1f1b", 2, 4)
    costs = FlopCosts(SHAPE, 64, num_stages=2, micro_batch_size=2, parallel=parallel)
    return simulate(schedule, costs).peak_memory_per_rank


def test_simulated_activation_peaks_shrink_as_megatron_shards_them() -> None:
    base, tp2, tp2_sp, cp2 = (
        _peaks(p) for p in (Parallelism(), Parallelism(tp=2), Parallelism(tp=2, sp=True), Parallelism(cp=2))
    )
    for rank in range(2):
        assert tp2_sp[rank] < tp2[rank] < base[rank]
        assert tp2_sp[rank] == pytest.approx(base[rank] / 2)  # Korthikanti: sbh(34 + ...)/t with SP
        assert cp2[rank] == pytest.approx(base[rank] / 2)


def test_p2p_messages_carry_one_ranks_share_of_the_sequence() -> None:
    schedule = generate("1f1b", 2, 2)
    op = schedule.compute_ops(0)[0]

    def message(parallel: Parallelism) -> float:
        costs = FlopCosts(SHAPE, 64, 2, p2p_latency=0.0, p2p_bandwidth=1.0, parallel=parallel)
        return costs.comm_latency(op)

    assert message(Parallelism()) == 64 * 8 * 2
    assert message(Parallelism(tp=2)) == 64 * 8 * 2  # without SP every TP rank sends the whole tensor
    assert message(Parallelism(tp=2, sp=True, cp=2)) == 64 * 8 * 2 / 4


@pytest.mark.parametrize(
    ("parallel", "seq", "flag"),
    [
        (Parallelism(sp=True), 64, "--sequence-parallel"),
        (Parallelism(tp=8), 64, "--tensor-model-parallel-size"),  # 4 heads
        (Parallelism(tp=4), 64, "--tensor-model-parallel-size"),  # 2 kv heads
        (Parallelism(tp=2, sp=True), 63, "--seq-length"),
        (Parallelism(cp=2), 66, "--seq-length"),  # 2 x CP chunks
        (Parallelism(dp=0), 64, "--data-parallel-size"),
    ],
)
def test_layouts_megatron_refuses(parallel: Parallelism, seq: int, flag: str) -> None:
    with pytest.raises(ParallelError) as error:
        check_parallel(SHAPE, seq, parallel)
    assert error.value.flag == flag and flag in str(error.value)


def test_accepted_layout_passes() -> None:
    check_parallel(SHAPE, 64, Parallelism(tp=2, sp=True, cp=2, dp=4, distributed_optimizer=True))


# ---- the CLI -------------------------------------------------------------------------------

BASE = ["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--model", "llama-7b"]


def _json(capsys, *extra: str) -> dict:
    assert main([*BASE, "--seq-length", "4096", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_gives_each_part_per_rank(capsys) -> None:
    plain = _json(capsys)
    parts = plain["memory_parts_bytes"]
    assert len(parts) == 4 and plain["parallel"]["tp"] == 1
    for rank, part in enumerate(parts):
        assert part["activations"] == plain["peak_memory_bytes"][rank]
        assert part["gradients"] == 2 * part["weights"]  # fp32 main_grad vs bf16 weights
        assert part["optimizer"] == 6 * part["weights"]  # 12 bytes per param
        assert part["total"] == pytest.approx(
            sum(part[k] for k in ("activations", "weights", "gradients", "optimizer"))
        )
    sharded = _json(
        capsys,
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--context-parallel-size",
        "2",
        "--data-parallel-size",
        "4",
        "--use-distributed-optimizer",
    )
    assert sharded["parallel"] == {"tp": 2, "sp": True, "cp": 2, "dp": 4, "distributed_optimizer": True}
    for a, b in zip(parts, sharded["memory_parts_bytes"]):
        assert b["activations"] == pytest.approx(a["activations"] / 4)
        assert b["weights"] < a["weights"] / 2 + 2**20  # halved but for the (small) norm weights
        assert b["optimizer"] == pytest.approx(b["weights"] * 6 / 8)  # over DP x CP = 8


def test_cli_table_shows_total_per_rank(capsys) -> None:
    assert main([*BASE, "--seq-length", "4096", "--pipeline-model-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "total GiB (max)" in out and "activations + weights + gradients + optimizer" in out
    assert out.count("  r") == 4


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_pp_ext", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--model", "llama-7b", "--sequence-parallel"], "--sequence-parallel"),
        (["--model", "llama-7b", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
        (["--model", "llama-70b", "--tensor-model-parallel-size", "16"], "--tensor-model-parallel-size"),
        (
            ["--model", "llama-7b", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--context-parallel-size", "2", "--seq-length", "4100"],
            "--seq-length",
        ),
        (["--data-parallel-size", "4"], "--data-parallel-size"),  # without --model
        (
            ["--schedule", "all", "--model", "llama-7b", "--context-parallel-size", "0"],
            "--context-parallel-size",
        ),
    ],
)
def test_cli_bad_layout_is_one_line_naming_the_flag(args: list[str], flag: str) -> None:
    done = run_cli("simulate", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], done.stderr


def test_memory_model_imports_without_torch() -> None:
    code = (
        "import sys; import megatron_pp_ext.schedule.memory_model, megatron_pp_ext.commands.simulate; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
