"""Checkpoints on real processes (gloo): 6 iterations straight equal 3 + save + resume + 3,
bitwise, for 1F1B, ZB-H2, V-ZB, SlimPipe with offload and V-Half with vocabulary parallelism; a
V-ZB checkpoint continues under 1F1B (also vocabulary-parallel), interleaved 1F1B, PP=1 x TP=2,
PP=1 x DP=2 and Megatron's layer-split flags, the vocabulary-parallel one under 1F1B and
PP=1 x TP=2 without it; a save interrupted halfway leaves the previous checkpoint the one loaded.
One launch of two processes runs every job in a row; the tests read its results."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, train_tolerance

pytestmark = pytest.mark.slow

DATA = str(Path(__file__).resolve().parents[1] / "README.md")
COMMON = [
    "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1", "--microbatches", "4",
    "--data", DATA, "--pp-p2p-timeout", "60", "--train-iters", "6",
]  # fmt: skip
SCHEDULES = {
    "1f1b": ["--pp-schedule", "1f1b"],
    "zb-h2": ["--pp-schedule", "zb-h2"],
    "v-zb": ["--pp-schedule", "v-zb"],
    "slimpipe-offload": ["--pp-schedule", "slimpipe", "--pp-seq-slices", "2", "--pp-offload", "full"],
    "v-half-vocab-2": ["--pp-schedule", "v-half", "--pp-vocab-parallel", "vocab-2"],
}
# Layouts that continue from v-zb's iteration-3 checkpoint (2 processes each).
CROSS = {
    "1f1b-pp2": ["--pp", "2", "--pp-schedule", "1f1b"],
    "interleaved-pp2": ["--pp", "2", "--pp-schedule", "interleaved-1f1b"],
    "1f1b-pp1-tp2": ["--pp", "1", "--tensor-model-parallel-size", "2", "--pp-schedule", "1f1b"],
    "1f1b-pp1-dp2": ["--pp", "1", "--pp-schedule", "1f1b", "--global-batch-size", "4"],
    "1f1b-pp2-vocab-1": ["--pp", "2", "--pp-schedule", "1f1b", "--pp-vocab-parallel", "vocab-1"],
    # Megatron's layer-split flags: layers 1 + 3, and a layout whose end stages hold none
    "1f1b-pp2-first-1": ["--pp", "2", "--pp-schedule", "1f1b", "--decoder-first-pipeline-num-layers", "1"],
    "v-half-pp2-layout": "--pp 2 --pp-schedule v-half --pipeline-model-parallel-layout E|tt|tt|L".split(),
}
# Layouts that continue from the vocabulary-parallel (v-half, vocab-2) iteration-3 checkpoint.
FROM_VOCAB = {
    "1f1b-pp2": ["--pp", "2", "--pp-schedule", "1f1b"],
    "1f1b-pp1-tp2": ["--pp", "1", "--tensor-model-parallel-size", "2", "--pp-schedule", "1f1b"],
}


class SaveInterrupted(OSError):
    pass


def jobs_worker(rank: int, world: int, root: str, wanted: dict[str, list[str]]) -> dict[str, Any]:
    """Every job the selected tests read (``wanted``: names per table, "interrupted" or not)."""
    from megatron.core import dist_checkpointing

    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.megatron.checkpoint import read_tracker
    from megatron_pp_ext.training.worker import train_loop

    cpu = torch.device("cpu")

    def run(argv: list[str]) -> list[dict]:
        return train_loop(rank, settings_from_argv(COMMON + argv, world), cpu)

    out: dict[str, Any] = {}
    for name, flags in SCHEDULES.items():
        if name not in wanted["schedules"]:
            continue
        pp2 = ["--pp", "2", *flags]
        out[f"{name}/straight"] = run([*pp2, "--save", f"{root}/{name}/straight", "--save-interval", "3"])
        resume = ["--load", f"{root}/{name}/straight", "--ckpt-step", "3", "--save", f"{root}/{name}/resumed"]
        out[f"{name}/resumed"] = run([*pp2, *resume])
    for name, flags in CROSS.items():
        if name not in wanted["cross"]:
            continue
        out[f"cross/{name}"] = run([*flags, "--load", f"{root}/v-zb/straight", "--ckpt-step", "3"])
    for name, flags in FROM_VOCAB.items():
        if name not in wanted["from_vocab"]:
            continue
        vocab_checkpoint = ["--load", f"{root}/v-half-vocab-2/straight", "--ckpt-step", "3"]
        out[f"from-vocab/{name}"] = run([*flags, *vocab_checkpoint])

    if not wanted["interrupted"]:
        return out
    # A save that fails after writing its files (a full disk, a crash): the tracker still names
    # the previous checkpoint, which loads; the next save clears the leftovers.
    saves = f"{root}/interrupted"
    run(["--pp", "2", "--train-iters", "2", "--save", saves])
    real_save = dist_checkpointing.save

    def failing_save(*args: Any, **kwargs: Any) -> None:
        real_save(*args, **kwargs)
        raise SaveInterrupted("no space left on device (simulated)")

    dist_checkpointing.save = failing_save
    try:
        run(["--pp", "2", "--train-iters", "3", "--load", saves, "--save", saves])
        out["interrupted/error"] = None
    except SaveInterrupted as error:
        out["interrupted/error"] = str(error)
    finally:
        dist_checkpointing.save = real_save
    out["interrupted/tracker"] = read_tracker(saves)
    out["interrupted/files"] = sorted(path.name for path in Path(saves).iterdir())
    torch.distributed.barrier()
    out["interrupted/resumed"] = run(["--pp", "2", "--train-iters", "3", "--load", saves, "--save", saves])
    out["interrupted/files_after"] = sorted(path.name for path in Path(saves).iterdir())
    return out


def _wanted(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The jobs the session's selected tests of this module read (the quick tier selects fewer:
    ``tiers.py``); a checkpoint another table continues from is always made."""
    selected = [item for item in request.session.items if item.module is request.module]

    def names(test: Any) -> list[str]:
        return [item.callspec.params["name"] for item in selected if item.originalname == test.__name__]

    schedules = set(names(test_six_iterations_equal_three_saved_resumed_and_three_more))
    schedules |= set(names(test_checkpoint_holds_global_tensors_whatever_the_placement))
    cross, from_vocab = (
        names(test_v_zb_checkpoint_continues_under_another_schedule_or_layout),
        names(test_vocab_parallel_checkpoint_continues_without_it),
    )
    schedules |= {"v-zb"} if cross else set()
    schedules |= {"v-half-vocab-2"} if from_vocab else set()
    interrupted = any(
        item.originalname == "test_interrupted_save_leaves_the_previous_checkpoint_loadable"
        for item in selected
    )
    return {
        "schedules": sorted(schedules),
        "cross": cross,
        "from_vocab": from_vocab,
        "interrupted": interrupted,
    }


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, dict[str, list]]:
    root = tmp_path_factory.mktemp("checkpoints")
    results = check_ok(run_ranks(jobs_worker, 2, str(root), _wanted(request), timeout=600))
    merged: dict[str, list] = {}
    for key in results[0]:
        if isinstance(results[0][key], list) and results[0][key] and isinstance(results[0][key][0], dict):
            # the reporting rank's loss, every rank's step outcome
            merged[key] = [
                {**rows[0], "loss": next(r["loss"] for r in rows if r["loss"] is not None)}
                for rows in zip(*(result[key] for result in results))
            ]
        else:
            merged[key] = [result[key] for result in results]
    return root, merged


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer), read as whole global tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, f"{scratch}/all.pt")
        state = torch.load(f"{scratch}/all.pt", weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value)}


def losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_six_iterations_equal_three_saved_resumed_and_three_more(jobs, name: str) -> None:
    root, results = jobs
    straight, resumed = results[f"{name}/straight"], results[f"{name}/resumed"]
    assert [row["iteration"] for row in straight] == [1, 2, 3, 4, 5, 6]
    assert [row["iteration"] for row in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(straight)[3:]  # bitwise
    assert [row["grad_norm"] for row in resumed] == [row["grad_norm"] for row in straight][3:]
    final, again = (
        tensors(root / name / "straight/iter_0000006"),
        tensors(root / name / "resumed/iter_0000006"),
    )
    assert sorted(final) == sorted(again)
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in final)
    for key, value in final.items():
        assert torch.equal(value, again[key]), key  # weights and Adam moments, bitwise
    if name == "slimpipe-offload":
        assert all(row["offloaded_bytes"] for row in straight)


@pytest.mark.parametrize("name", ["v-zb", "v-half-vocab-2"])
def test_checkpoint_holds_global_tensors_whatever_the_placement(jobs, name: str) -> None:
    """V-shape placement (stage 2p-1-r on rank r) writes the same global layer stack as 1F1B;
    vocabulary-parallel shards (uneven row ranges over the ranks) write Megatron's whole
    embedding and output tables, weights and Adam moments."""
    root, _ = jobs
    v_shape, plain = (
        tensors(root / f"{name}/straight/iter_0000003"),
        tensors(root / "1f1b/straight/iter_0000003"),
    )
    assert sorted(v_shape) == sorted(plain)
    assert v_shape["decoder.layers.mlp.linear_fc2.weight"].shape[0] == 4  # every layer, in order
    assert plain["output_layer.weight"].shape == v_shape["output_layer.weight"].shape
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in v_shape
    # Same model after 3 identical steps. v-zb adds the same numbers (bitwise here). The vocabulary
    # shards compute the cross-entropy and its gradient in pieces, so float rounding differs, and
    # Adam, which divides by sqrt(v), can turn that into most of a step (lr 3e-3) on a weight
    # element whose gradient is near zero (seen: 4e-6 to 3e-5, run to run). So there: 99% of the
    # elements within 1e-6 + 1e-4 relative, none more than the 3 steps apart; a shard written to
    # the wrong rows would be off by the weights themselves (~0.02) nearly everywhere.
    for key, value in plain.items():
        if "vocab" not in name:
            torch.testing.assert_close(v_shape[key], value, rtol=1e-4, atol=1e-6, msg=key)
            continue
        diff = (v_shape[key] - value).abs()
        assert (diff <= 1e-6 + 1e-4 * value.abs()).float().mean() > 0.99, key
        assert diff.max() <= 3 * 3e-3, key


@pytest.mark.parametrize("name", list(CROSS))
def test_v_zb_checkpoint_continues_under_another_schedule_or_layout(jobs, name: str) -> None:
    _, results = jobs
    rows, reference = results[f"cross/{name}"], results["v-zb/straight"][3:]
    assert [row["iteration"] for row in rows] == [4, 5, 6]
    # Not bitwise: another schedule or layout adds the microbatches' (DP: ranks') gradients in
    # another order, so the float sums differ in their last bits.
    limit = train_tolerance(steps=6, global_batch=4, num_layers=4, seq_length=32)  # COMMON's
    for step, (got, want) in enumerate(zip(losses(rows), losses(reference), strict=True)):
        check(abs(got - want) / abs(want), limit, f"iteration {step + 4} loss")


@pytest.mark.parametrize("name", list(FROM_VOCAB))
def test_vocab_parallel_checkpoint_continues_without_it(jobs, name: str) -> None:
    _, results = jobs
    rows, reference = results[f"from-vocab/{name}"], results["v-half-vocab-2/straight"][3:]
    assert [row["iteration"] for row in rows] == [4, 5, 6]
    limit = train_tolerance(steps=6, global_batch=4, num_layers=4, seq_length=32)  # COMMON's
    for step, (got, want) in enumerate(zip(losses(rows), losses(reference), strict=True)):
        check(abs(got - want) / abs(want), limit, f"iteration {step + 4} loss")


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(jobs) -> None:
    _, results = jobs
    assert results["interrupted/error"] == ["no space left on device (simulated)"] * 2
    assert results["interrupted/tracker"] == [2, 2]  # the tracker still names iteration 2
    files = results["interrupted/files"][0]
    assert "iter_0000003.tmp" in files and "iter_0000003" not in files, files
    rows = results["interrupted/resumed"]
    assert [row["iteration"] for row in rows] == [3]  # resumed from 2
    assert results["interrupted/files_after"][0] == [
        "iter_0000002",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]
