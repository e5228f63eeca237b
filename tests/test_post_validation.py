"""Optimizer post-validation (Zero Bubble, section 4) on real processes (gloo): steps taken
before the global gradient check, rolled back when it fails, give bitwise the synchronous
optimizer's losses, gradient norms, weights and Adam moments, in fp32 and bf16, including a step
whose gradient holds an injected inf (skipped and reported) and steps that need clipping.

The next iteration starts before the check is in and waits for it at its validation gate
(``schedule/gate.py``); after a failed check every rank restarts that iteration from its first
op with the same data. V-ZB passes the partial state up (rank 0 finishes first), ZB-H1 down."""

from __future__ import annotations

import contextlib
import io
import math
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dist_utils import check_ok, run_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1", "--microbatches", "4",
    "--pp-p2p-timeout", "60", "--train-iters", "5", "--pp", "2",
]  # fmt: skip
INF_ITERATION = 3  # the second microbatch of this iteration gets an inf in its gradient
CLIP_GRAD = 2.4  # with DATA: some steps need clipping (rolled back), some not
CASES = {"v-zb-fp32": ("v-zb", "float32"), "zb-h1-bf16": ("zb-h1", "bfloat16")}
POST = ["--pp-post-validation"]
MODES = (
    ("sync", []),
    ("post", [*POST, "--pp-post-validation-chain", "auto"]),  # the schedule's order: reproducible
    ("measured", POST),  # the order timed over the first iterations
)


class _InfGradient(torch.autograd.Function):
    """Identity forward; backward puts an inf into one element of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


class InjectInf:
    """Megatron's forward step; in iteration ``INF_ITERATION`` the first stage's output for the
    second microbatch passes through :class:`_InfGradient`, so only the first stage's weights
    (rank 0) get the inf. Microbatches are told apart by their batch (a restarted iteration runs
    its forwards again on the same batches)."""

    def __init__(self, microbatches: int) -> None:
        self.target = (INF_ITERATION - 1) * microbatches + 2
        self.seen: list[Any] = []  # the first stage's batches, in data order

    def __call__(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        from megatron.core.utils import unwrap_model

        from megatron_pp_ext.megatron.steps import forward_step

        inner = unwrap_model(model)
        if not (inner.pre_process and not inner.post_process):
            return forward_step(data_iterator, model)
        batch = next(data_iterator)
        if not any(batch is seen for seen in self.seen):
            self.seen.append(batch)
        number = next(i for i, seen in enumerate(self.seen, 1) if seen is batch)
        output, loss_func = forward_step(iter([batch]), model)
        if number == self.target:
            output = _InfGradient.apply(output)
        return output, loss_func


def data_text() -> str:
    """Fixed text to train on (not a repository file, whose edits would move the gradient norms
    across CLIP_GRAD): 400 lines of 12 words drawn with a seeded generator."""
    import random

    words = "pipeline stage rank forward backward weight gradient bubble schedule tensor memory offload"
    words += " slice vocabulary optimizer the a of and to"
    rng = random.Random(1234)
    return "\n".join(" ".join(rng.choice(words.split()) for _ in range(12)) + "." for _ in range(400))


def config_file(directory: str, dtype: str) -> None:
    """tiny-llama with clip_grad 2: some steps need clipping (rolled back), some not."""
    config = yaml.safe_load((REPO / "configs/tiny-llama.yaml").read_text())
    config["model"]["dtype"] = dtype
    config["training"]["clip_grad"] = CLIP_GRAD
    (Path(directory) / f"tiny-{dtype}.yaml").write_text(yaml.safe_dump(config))


def worker(rank: int, world: int, root: str) -> dict[str, Any]:
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.training.worker import train_loop

    out: dict[str, Any] = {}
    for name, (schedule, dtype) in CASES.items():
        if rank == 0:
            config_file(root, dtype)
        torch.distributed.barrier()
        config = str(Path(root) / f"tiny-{dtype}.yaml")
        for mode, flags in MODES:
            argv = [
                *COMMON,
                "--config",
                config,
                "--pp-schedule",
                schedule,
                "--data",
                f"{root}/data.txt",
                *flags,
            ]
            argv += ["--save", f"{root}/{name}/{mode}"]
            settings = settings_from_argv(argv, world)
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                rows = train_loop(rank, settings, torch.device("cpu"), InjectInf(settings.microbatches))
            out[f"{name}/{mode}"] = rows
            out[f"{name}/{mode}/log"] = log.getvalue()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("post-validation")
    (root / "data.txt").write_text(data_text())
    return root, check_ok(run_ranks(worker, 2, str(root), timeout=600))


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, f"{scratch}/all.pt")
        state = torch.load(f"{scratch}/all.pt", weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value)}


def same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("name", list(CASES))
def test_post_validation_is_bitwise_the_synchronous_step(runs, name: str) -> None:
    root, results = runs
    for mode in ("post", "measured"):
        for rank, result in enumerate(results):
            sync, post = result[f"{name}/sync"], result[f"{name}/{mode}"]
            assert len(sync) == len(post) == 5
            for a, b in zip(sync, post):
                assert same(a["loss"], b["loss"]) and same(a["grad_norm"], b["grad_norm"]), (rank, a, b)
                assert a["skipped"] == b["skipped"]
            # the injected inf: every rank skips that step, and only that one
            assert [row["skipped"] for row in post] == [i == INF_ITERATION for i in range(1, 6)]
            assert not math.isfinite(post[INF_ITERATION - 1]["grad_norm"])
        final_sync, final_post = (
            tensors(root / name / "sync/iter_0000005"),
            tensors(root / name / f"{mode}/iter_0000005"),
        )
        assert sorted(final_sync) == sorted(final_post)
        for key, value in final_sync.items():
            assert torch.equal(value, final_post[key]), (mode, key)


def test_the_measured_chain_is_reported(runs) -> None:
    """Timed over the first iterations, the order is some order of both ranks, said in the log."""
    _, results = runs
    for name in CASES:
        log = "".join(result[f"{name}/measured/log"] for result in results)
        said = r"post-validation: partial state along rank ([01]) \(\d+ ms\) > rank (?!\1)[01] "
        assert re.search(said, log), log


@pytest.mark.parametrize("name", list(CASES))
def test_the_first_rank_of_the_chain_steps_early_and_rolls_back(runs, name: str) -> None:
    """The partial state goes in completion order: ZB-H1's rank 1 finishes first, V-ZB's rank 0.
    The first rank of the chain sees only its own gradients: it steps before the global check,
    keeps some steps and rolls back those that needed clipping; the inf is on rank 0, so under
    ZB-H1 rank 1 also steps on it and rolls back, under V-ZB rank 0 sees it and waits. The last
    rank of the chain takes the global state at once (it is complete by then): never early."""
    _, results = runs
    first = {"v-zb-fp32": 0, "zb-h1-bf16": 1}[name]
    rows = results[first][f"{name}/post"]
    assert any(row["optimistic"] and not row["rolled_back"] for row in rows)
    assert any(row["rolled_back"] and not row["skipped"] for row in rows)  # clipping
    inf_row = rows[INF_ITERATION - 1]
    assert inf_row["rolled_back"] == (first == 1) and inf_row["optimistic"] == (first == 1)
    assert all(not row["optimistic"] for row in results[1 - first][f"{name}/post"])


@pytest.mark.parametrize("name", list(CASES))
def test_an_iteration_restarts_on_every_rank_after_a_failed_check(runs, name: str) -> None:
    """Iteration i+1 ran its forwards with step i's optimistic weights: it restarts, on every
    rank, exactly when step i failed its global check (skipped, or clipped: norm above the
    config's clip_grad 2), never otherwise."""
    _, results = runs
    for result in results:
        rows = result[f"{name}/post"]
        failed = [row["skipped"] or row["grad_norm"] > CLIP_GRAD for row in rows]
        assert [row["restarted"] for row in rows] == [False, *failed[:-1]]
        assert all(not row["restarted"] for row in result[f"{name}/sync"])
        assert any(failed[:-1]) and not all(failed[:-1])


def test_skipped_step_is_reported_in_the_log(runs) -> None:
    _, results = runs
    log = results[0]["v-zb-fp32/post/log"]  # v-zb reports on rank 0
    assert f"iteration {INF_ITERATION}: optimizer step skipped" in log, log[-2000:]
    assert "skipped=1" in log


@pytest.mark.parametrize(
    "requested, post_validation, cuda, built",
    [
        ("auto", False, True, "megatron"),
        ("auto", True, True, "torch"),
        ("auto", False, False, "torch"),
        ("torch", False, True, "torch"),
        ("megatron", False, True, "megatron"),
    ],
)
def test_pp_optimizer_picks_the_optimizer(
    requested: str, post_validation: bool, cuda: bool, built: str
) -> None:
    """``--pp-optimizer torch`` on a GPU builds the optimizer post-validation steps, so the GPU
    round compares post-validation against the same optimizer without it."""
    from megatron_pp_ext.megatron.optimizer import optimizer_kind

    assert optimizer_kind(requested, post_validation, cuda) == built
