"""Mixture-of-experts models through ``train`` (Megatron-LM's MoE flags, the MoE configs) on real
processes: the experts split over two ranks of each stage (EP 2, DP 2) train as they do on one;
a checkpoint resumes bitwise under its own layout (there under NCCL's rules, the expert groups
in the warm-up) and, within the suite's tolerance, under EP 1 and another schedule; the configs
build MoE layers where they say (tiny-deepseek: a dense first layer, then routed experts beside
a shared one).

Each rank of an EP group holds other experts: the weights are the same whatever the EP size
because every expert is drawn from a generator of its own (``model.seed_experts``), and the
gradient norm sums the experts' squares over the expert-parallel ranks (``optimizer.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from dist_utils import check_ok, run_ranks
from exactness import check, training_tolerance

pytestmark = pytest.mark.slow

README = str(Path(__file__).resolve().parents[1] / "README.md")
COMMON = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.001", "--num-layers", "4", "--pp", "2", "--data-parallel-size", "2",
    "--microbatches", "4", "--data", README, "--train-iters", "3",
]  # fmt: skip
# name: (flags, loaded checkpoint step or None)
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]  # on CPU through cpu_shim's host stream
RUNS = {
    "ep2": (
        ["--expert-model-parallel-size", "2", "--pp-schedule", "zb-h1", "--save-interval", "2", *ALLTOALL],
        None,
    ),
    "ep2-allgather": (["--expert-model-parallel-size", "2", "--pp-schedule", "zb-h1"], None),
    "ep1": (["--expert-model-parallel-size", "1", "--pp-schedule", "zb-h1"], None),
    "resumed": (
        ["--expert-model-parallel-size", "2", "--pp-schedule", "zb-h1", "--pp-emulate-nccl", *ALLTOALL],
        2,
    ),
    "resumed-ep1-dualpipev": (["--expert-model-parallel-size", "1", "--pp-schedule", "dualpipev"], 2),
}


class Runs:
    """The train runs of :data:`RUNS`, each run once on first use (the quick tier uses fewer)."""

    def __init__(self, root: Path) -> None:
        self.root, self.rows = root, {}

    def __getitem__(self, name: str) -> list[dict]:
        if name not in self.rows:
            flags, step = RUNS[name]
            if step is not None:
                self["ep2"]  # noqa: B018  (the run that saves the checkpoint)
            metrics = self.root / f"{name}.jsonl"
            saving = ["--save", str(self.root / "ckpt")] if name == "ep2" else []
            loading = [] if step is None else ["--load", str(self.root / "ckpt"), "--ckpt-step", str(step)]
            argv = ["train", *COMMON, *flags, *saving, *loading, "--metrics", str(metrics)]
            done = run_cli(argv, timeout=600)
            assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
            self.rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
        return self.rows[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("moe"))


def _tolerance(steps: int) -> float:
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.training.model import model_config

    settings = settings_from_argv(COMMON)
    return training_tolerance(model_config(settings), settings.microbatches, steps, data_parallel=2)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_experts_over_two_ranks_train_as_over_one(runs, dispatcher: str) -> None:
    """EP 2 (each rank of a stage two of the four experts, tokens exchanged by megatron-core's
    alltoall or allgather dispatcher) against EP 1 (allgather, no exchange)."""
    for one, two in zip(
        runs["ep1"], runs["ep2" if dispatcher == "alltoall" else "ep2-allgather"], strict=True
    ):
        limit = _tolerance(one["iteration"])
        check(_relative(two["loss"], one["loss"]), limit, f"loss of iteration {one['iteration']}")
        check(
            _relative(two["grad_norm"], one["grad_norm"]), limit, f"grad norm of iteration {one['iteration']}"
        )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "v-zb"])
def test_other_schedule_families_with_experts_over_two_ranks_train_as_over_one(
    runs, schedule: str, tmp_path: Path
) -> None:
    """Interleaved 1F1B and a V-shape at EP 2 (alltoall) against ZB-H1 at EP 1: the schedule and
    the expert split change nothing (ZB-H1 above; DualPipeV and 1F1B through pretrain_gpt.py)."""
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--expert-model-parallel-size", "2", *ALLTOALL, "--pp-schedule", schedule]
    done = run_cli(["train", *COMMON, *flags, "--metrics", str(metrics)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for one, two in zip(runs["ep1"], rows, strict=True):
        limit, at = _tolerance(one["iteration"]), f"{schedule}, iteration {one['iteration']}"
        check(_relative(two["loss"], one["loss"]), limit, f"loss of {at}")
        check(_relative(two["grad_norm"], one["grad_norm"]), limit, f"grad norm of {at}")


@pytest.mark.parametrize("schedule", ["dualpipev"])
def test_overlapped_pairs_train_as_experts_over_one_rank(runs, schedule: str, tmp_path: Path) -> None:
    """``--overlap-moe-expert-parallel-comm``: DualPipeV's F&B pairs run as units through
    megatron-core's schedule plan, the all-to-alls on a thread of their own, under NCCL's rules;
    the losses and gradient norms are ZB-H1's at EP 1 (tests/test_expert_overlap.py compares every
    gradient, paired against unpaired)."""
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--expert-model-parallel-size", "2", *ALLTOALL, "--pp-schedule", schedule, "--pp-emulate-nccl"]
    flags.append("--overlap-moe-expert-parallel-comm")
    done = run_cli(["train", *COMMON, *flags, "--metrics", str(metrics)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("overlapped pairs") == 4, done.stdout[-2000:]  # every rank ran pairs
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for one, two in zip(runs["ep1"], rows, strict=True):
        limit, at = _tolerance(one["iteration"]), f"paired {schedule}, iteration {one['iteration']}"
        check(_relative(two["loss"], one["loss"]), limit, f"loss of {at}")
        check(_relative(two["grad_norm"], one["grad_norm"]), limit, f"grad norm of {at}")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--expert-model-parallel-size", "2"], "--moe-token-dispatcher-type alltoall"),
        (["--expert-model-parallel-size", "1", *ALLTOALL], "--expert-model-parallel-size 2"),
        (
            [
                "--expert-model-parallel-size",
                "2",
                *ALLTOALL,
                "--pp-schedule",
                "seq1f1b",
                "--pp-seq-slices",
                "2",
            ],
            "slices",
        ),
    ],
)
def test_overlapped_pairs_refuse_what_they_cannot_run_before_processes_start(flags: list, named: str) -> None:
    done = run_cli(["train", *COMMON, *flags, "--overlap-moe-expert-parallel-comm"], timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert "--overlap-moe-expert-parallel-comm" in error and named in error, error


def test_a_checkpoint_resumes_bitwise_under_its_layout(runs) -> None:
    straight = {row["iteration"]: row for row in runs["ep2"]}
    resumed = runs["resumed"]
    assert [row["iteration"] for row in resumed] == [3]
    for row in resumed:
        assert (row["loss"], row["grad_norm"]) == (
            straight[row["iteration"]]["loss"],
            straight[row["iteration"]]["grad_norm"],
        )


def test_a_checkpoint_resumes_under_one_ep_rank_and_another_schedule(runs) -> None:
    straight = {row["iteration"]: row for row in runs["ep2"]}
    for row in runs["resumed-ep1-dualpipev"]:
        limit = _tolerance(row["iteration"])
        check(_relative(row["loss"], straight[row["iteration"]]["loss"]), limit, f"loss {row['iteration']}")


def test_experts_split_over_tensor_or_context_parallel_ranks_train_as_on_one(tmp_path: Path) -> None:
    """TP 2 with sequence parallelism, the experts split over the two tensor-parallel ranks
    (EP 2, expert TP 1) under ZB-H1 (the experts' deferred W ops use their own group, not the
    TP group: before, ranks exchanged different token counts and gloo aborted), and CP 2 with
    the experts split over the two context-parallel ranks (EP 2), give TP 1's losses and
    gradient norms."""
    at = COMMON.index("--data-parallel-size")
    common = [*COMMON[:at], *COMMON[at + 2 :], "--pp-schedule", "zb-h1"]  # one data-parallel rank
    layouts = {
        "tp1": [],
        "tp2-ep2": [
            "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
        ],
        "cp2-ep2": ["--context-parallel-size", "2", "--expert-model-parallel-size", "2", *ALLTOALL],
    }  # fmt: skip
    rows = {}
    for name, flags in layouts.items():
        metrics = tmp_path / f"{name}.jsonl"
        argv = ["train", *common, *flags, "--train-iters", "2", "--metrics", str(metrics)]
        done = run_cli(argv, timeout=600)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    for layout in ("tp2-ep2", "cp2-ep2"):
        for one, two in zip(rows["tp1"], rows[layout], strict=True):
            limit, at = _tolerance(one["iteration"]), f"{layout}, iteration {one['iteration']}"
            check(_relative(two["loss"], one["loss"]), limit, f"loss of {at}")
            check(_relative(two["grad_norm"], one["grad_norm"]), limit, f"grad norm of {at}")


def layers_worker(rank: int, world: int, config: str) -> list[tuple[str, int | None, bool]]:
    """(MLP class, routed experts, shared expert) of each layer of ``config``'s model."""
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.megatron.model import build_reference, init_parallel_state
    from megatron_pp_ext.training.model import model_config

    init_parallel_state(1)
    reference = build_reference(model_config(settings_from_argv(["--config", config, "--pp", "1"], 1)))
    out = []
    for layer in reference.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        count = None if experts is None else len(experts.local_experts)
        out.append((type(layer.mlp).__name__, count, getattr(layer.mlp, "shared_experts", None) is not None))
    return out


@pytest.mark.parametrize(
    "config, expected",
    [
        ("tiny-mixtral", [("MoELayer", 8, False)] * 8),
        ("tiny-deepseek", [("MLP", None, False)] + [("MoELayer", 16, True)] * 7),
    ],
)
def test_configs_build_moe_layers_where_they_say(config: str, expected: list) -> None:
    (layers,) = check_ok(run_ranks(layers_worker, 1, config))
    assert layers == expected


@pytest.mark.parametrize("schedule, refused", [("zb-h1", True), ("1f1b", False)])
def test_grouped_gemm_on_a_gpu_is_refused_with_a_b_w_split(monkeypatch, schedule: str, refused: bool) -> None:
    """On a GPU, TE's grouped expert linears are not yet covered by W ops: a B/W-split schedule
    refuses --moe-grouped-gemm before processes start; 1F1B takes it."""
    import torch

    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--num-experts", "4", "--moe-grouped-gemm", "--pp-schedule", schedule]
    if not refused:
        settings_from_argv(argv)
        return
    with pytest.raises(UsageError, match="--moe-grouped-gemm") as error:
        settings_from_argv(argv)
    assert "W ops" in str(error.value) and "\n" not in str(error.value)
