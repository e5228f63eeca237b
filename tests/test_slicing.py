"""The pieces of sequence-sliced training: cutting batches, feeding slices, combining loss
reports, rotary positions of a slice, and the early errors of the hook and the train command."""

from __future__ import annotations

import argparse
import subprocess

import pytest
import torch
from cli_runner import run_cli
from dist_utils import check_ok, run_ranks

from megatron_pp_ext.megatron import hook
from megatron_pp_ext.runtime.slicing import (
    SliceFeeder,
    SliceLosses,
    combine_reports,
    slice_batch,
    slice_contexts,
    sliced_loss,
)
from megatron_pp_ext.schedule.models import megatron_shape


def test_slice_batch_cuts_sequence_tensors_and_the_mask() -> None:
    batch = {
        "tokens": torch.arange(12).reshape(2, 6),
        "attention_mask": torch.ones(2, 1, 6, 6, dtype=torch.bool),
        "scalar": torch.tensor(3.0),
        "other": [torch.zeros(2, 6), None],
    }
    cut = slice_batch(batch, 2, 5, 6)
    assert cut["tokens"].tolist() == [[2, 3, 4], [8, 9, 10]]
    assert cut["attention_mask"].shape == (2, 1, 3, 5)  # rows of the slice, keys up to its end
    assert cut["scalar"] is batch["scalar"] and cut["other"][1] is None
    assert cut["other"][0].shape == (2, 3)


def test_feeder_pulls_each_microbatch_once_and_yields_its_slices() -> None:
    pulled = []

    def source():
        for mb in range(2):
            pulled.append(mb)
            yield {"tokens": torch.arange(8).reshape(1, 8) + 100 * mb}

    feeder = SliceFeeder(source(), [3, 5])
    seen = []
    for mb in range(2):
        for j in range(2):
            feeder.select(mb, j)
            seen.append(next(feeder)["tokens"].tolist()[0])
    assert pulled == [0, 1]
    assert seen == [[0, 1, 2], [3, 4, 5, 6, 7], [100, 101, 102], [103, 104, 105, 106, 107]]


def test_slice_reports_sum_and_the_loss_is_normalised_over_all_slices() -> None:
    parts = SliceLosses()
    parts.add(torch.tensor(3), {"lm loss": torch.tensor([6.0, 3.0])})
    parts.add(torch.tensor(1), {"lm loss": torch.tensor([2.0, 1.0])})
    assert combine_reports(parts.reports)["lm loss"].tolist() == [8.0, 4.0]
    # Slice losses 6 and 2 over 4 tokens of the microbatch, 2 microbatches: 8 / 4 / 2 = 1.
    normalise = parts.normaliser(num_microbatches=2)
    assert float(normalise(torch.tensor(6.0)) + normalise(torch.tensor(2.0))) == 1.0
    with pytest.raises(ValueError, match=r"\(loss_sum, num_tokens, report\)"):
        sliced_loss((torch.tensor(1.0), {}))
    with pytest.raises(TypeError, match="cannot combine"):
        combine_reports(["a", "b"])


def test_a_plain_chunk_is_refused_for_a_sliced_schedule() -> None:
    with pytest.raises(ValueError, match=r"sliced=True"):
        slice_contexts([torch.nn.Linear(2, 2)])


def rotary_worker(rank: int, world: int) -> dict:
    """One process: the whole model slice by slice against the unsliced model, with and without
    the slice's rotary offset."""
    from megatron_pp_ext.megatron.model import ModelConfig, build_reference, init_parallel_state
    from megatron_pp_ext.megatron.sliced import slice_context_of

    init_parallel_state(1)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        seq_length=64,
        init_std=0.2,  # sharp enough attention that positions show in the loss
    )
    torch.manual_seed(0)
    plain = build_reference(cfg)
    sliced = build_reference(cfg, sliced=True)
    sliced.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    labels = torch.randint(0, cfg.vocab_size, (2, 64))
    positions = torch.arange(64).unsqueeze(0).expand(2, -1)
    whole = plain(tokens, positions, None, labels=labels)
    whole.sum().backward()
    context = slice_context_of(sliced)
    lengths = [24, 16, 16, 8]
    context.set_slicing(lengths, 64)

    def run(model: torch.nn.Module, microbatch: int) -> list[torch.Tensor]:
        outs, start = [], 0
        for j, length in enumerate(lengths):
            cut = slice(start, start + length)
            with context.running(microbatch, j):
                outs.append(model(tokens[:, cut], positions[:, cut], None, labels=labels[:, cut]))
            start += length
        return outs

    outs = run(sliced, 0)
    for out in reversed(outs):
        out.sum().backward()
    grads = dict(plain.named_parameters())
    grad_error = max(
        float((p.grad - grads[n].grad).norm() / grads[n].grad.norm()) for n, p in sliced.named_parameters()
    )
    forward_error = float((torch.cat(outs, 1) - whole).detach().abs().max())
    sliced.rotary_pos_emb.slice_context = None  # every slice from position 0: wrong
    with torch.no_grad():
        unshifted = float((torch.cat(run(sliced, 1), 1) - whole).abs().max())
    return {
        "forward": forward_error,
        "grad": grad_error,
        "unshifted": unshifted,
        "cached": context.cached_microbatches(),
    }


def test_slices_with_rotary_offsets_equal_the_whole_sequence() -> None:
    (result,) = check_ok(run_ranks(rotary_worker, 1, timeout=120))
    assert result["forward"] < 1e-5 and result["grad"] < 1e-5, result
    assert result["unshifted"] > 1000 * max(result["forward"], 1e-7), result  # the offset matters
    assert result["cached"] == [], result  # every K/V cache freed after the last backward


def test_hook_refuses_a_sequence_it_cannot_cut_before_training() -> None:
    args = argparse.Namespace(
        pp_schedule="slimpipe",
        pp_seq_slices=3,
        pipeline_model_parallel_size=4,
        global_batch_size=8,
        micro_batch_size=1,
        data_parallel_size=1,
        seq_length=4096,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        ffn_hidden_size=176,
        swiglu=True,
    )
    try:
        with pytest.raises(hook.OptionError, match=r"^--pp-seq-slices: .*valid --pp-seq-slices: 2, 4"):
            hook.install(args)
        args.pp_seq_slices, args.seq_length = 4, 4100
        with pytest.raises(hook.OptionError, match=r"^--seq-length: .*valid --seq-length: 4096, 4104"):
            hook.install(args)
        args.seq_length, args.pp_slice_partition = 4096, "balanced"
        installed = hook.install(args)
        schedule = installed.schedule(4, 8)
        lengths = installed.options.slice_lengths(schedule, 4096, megatron_shape(args))
        assert sum(lengths) == 4096 and lengths[0] > lengths[-1]
    finally:
        hook.uninstall()


def train(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_cli(["train", *args], timeout=timeout)


def test_train_names_the_slice_flag_before_processes_start() -> None:
    done = train("--config", "tiny-llama-long", "--pp-seq-slices", "3", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--pp-seq-slices" in last and "nearest valid --pp-seq-slices: 2, 4" in last, last
    assert "train:" not in done.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_long_context_config_trains() -> None:
    done = train("--config", "tiny-llama-long", "--iterations", "3", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "slimpipe: pp=4 tp=1 dp=1 m=4 v=1 k=8" in done.stdout, done.stdout[-2000:]
    for rank in range(4):
        assert f"rank {rank}: step" in done.stdout
