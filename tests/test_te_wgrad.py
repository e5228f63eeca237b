"""The B/W split on Transformer Engine linears (``runtime/te_wgrad.py``), against a test double of
TE's deferred weight gradient (``te_double.py``: TE needs CUDA; the GPU phase ``bw-split`` of
``scripts/gpu_validate.sh`` runs the real one), and the TE-version refusal of both entry points.

Each runtime check runs in a one-rank gloo process (Megatron needs its parallel state)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, rel_error, tiny_model
from te_double import stand_in_te_version


def _run(check: str, *args):
    return check_ok(run_ranks(te_worker, 1, check, *args, timeout=120))[0]


def te_worker(rank: int, world: int, check: str, *args):
    from megatron_pp_ext.megatron.model import init_parallel_state

    init_parallel_state(1)
    return CHECKS[check](*args)


def _chunk(stage: int, delay: bool = True, fused: bool = False):
    from te_double import make_te_doubles

    from megatron_pp_ext.megatron.model import build_stage, split_layers

    model = tiny_model(4)
    torch.manual_seed(0)
    chunk = build_stage(model, stage, split_layers(model.num_layers, 3))
    doubles = make_te_doubles(chunk, delay_wgrad_compute=delay, fused=fused)
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    return model, chunk, doubles, shape


def _doubles(chunk) -> list[torch.nn.Module]:
    from te_double import DoubleTELinear

    return [m for m in chunk.modules() if isinstance(m, DoubleTELinear)]


def _grads(chunk) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in chunk.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        out[name] = grad.clone()
    return out


def _zero(chunk) -> None:
    chunk.zero_grad(set_to_none=True)
    for param in chunk.parameters():
        if getattr(param, "main_grad", None) is not None:
            param.main_grad.zero_()


def _error_of(call, kind: type[BaseException]) -> str:
    """The message of the ``kind`` error ``call()`` raises, or "no error"."""
    try:
        call()
    except kind as error:
        return str(error)
    return "no error"


def _runner(chunk, stage: int, store, meter=None):
    from megatron_pp_ext.runtime.memory import ActivationMeter
    from megatron_pp_ext.runtime.stage import StageRunner

    return StageRunner(chunk, stage, 3, chunk.config, meter or ActivationMeter(), store)


def _split_equals_fused(stage: int, fused: bool) -> dict:
    """F(0) F(1) B(0) BW(1) W(0) on TE doubles gives the gradients of BW(0) BW(1), and B leaves
    the TE weights untouched; TE's queues are empty after the step."""
    from megatron_pp_ext.runtime.stage import LossRecord
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore

    model, chunk, doubles, shape = _chunk(stage, fused=fused)
    batches = make_batches(model, 2)
    torch.manual_seed(1)
    inputs = [None if stage == 0 else torch.randn(shape) for _ in range(2)]
    output_grads = [None if stage == 2 else torch.randn(shape) for _ in range(2)]
    te_weights = [m.weight for m in _doubles(chunk)]
    results = {}
    for split in (False, True):
        _zero(chunk)
        store = WeightGradStore()
        runner = _runner(chunk, stage, store)
        for mb in range(2):
            runner.forward((mb, 0), inputs[mb], forward_step, iter([batches[mb]]), 2, LossRecord())
        input_grad = runner.backward((0, 0), output_grads[0], split=split)
        if split:
            untouched = all(w.grad is None and (not fused or not w.main_grad.any()) for w in te_weights)
            queued = [m.wgrad_store.context.qsize() for m in _doubles(chunk)]
        runner.backward((1, 0), output_grads[1], split=False)
        if split:
            runner.weight((0, 0))
        results[split] = (_grads(chunk), input_grad)
    errors = {n: rel_error(results[True][0][n], results[False][0][n]) for n in results[False][0]}
    left = [m.wgrad_store.context.qsize() for m in _doubles(chunk)]
    return {
        "doubles": doubles,
        "max_error": max(errors.values()),
        "input_error": 0.0 if stage == 0 else rel_error(results[True][1], results[False][1]),
        "untouched_in_b": untouched,
        "queued_after_b": queued,
        "left": left,
        "pending": store.pending(),
        "te_weights_nonzero": all(
            results[True][0][n].abs().sum() > 0
            for n, p in chunk.named_parameters()
            if any(p is w for w in te_weights)
        ),
    }


def _w_out_of_order() -> str:
    from megatron_pp_ext.runtime.stage import LossRecord
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore

    model, chunk, _, shape = _chunk(1)
    batches = make_batches(model, 2)
    runner = _runner(chunk, 1, WeightGradStore())
    for mb in range(2):
        runner.forward((mb, 0), torch.randn(shape), forward_step, iter([batches[mb]]), 2, LossRecord())
    for mb in range(2):
        runner.backward((mb, 0), torch.randn(shape), split=True)
    return _error_of(lambda: runner.weight((1, 0)), RuntimeError)


def _built_without_deferral() -> str:
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore

    _, chunk, _, _ = _chunk(1, delay=False)
    _runner(chunk, 1, None)  # no W ops on this chunk: accepted
    return _error_of(lambda: _runner(chunk, 1, WeightGradStore()), ValueError)


def _stale_queue() -> str:
    """A TE queue still holding an entry when a step starts (a failed step not discarded)."""
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore

    _, chunk, _, _ = _chunk(1)
    stale = _doubles(chunk)[0]
    stale.wgrad_store.context.put([[], lambda: (None, None)])
    return _error_of(lambda: _runner(chunk, 1, WeightGradStore()), RuntimeError)


def _forward_without_deferral() -> str:
    """A B after a forward that ran outside ``forwarding()`` is an error, not a dropped gradient."""
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore, attach_store, run_backward

    model, chunk, _, shape = _chunk(0)
    store = WeightGradStore()
    uncovered = attach_store(chunk, store)
    batch = make_batches(model, 1)[0]
    output, _ = forward_step(iter([batch]), chunk)

    def b_op() -> None:
        with store.collect("b"):
            run_backward(output.sum(), None, uncovered)

    return _error_of(b_op, RuntimeError)


def _no_store_runs_te_at_once() -> dict:
    """A chunk without W ops (store None) whose TE linears were built deferring: BW computes
    TE's weight gradients at once, nothing is queued."""
    from megatron_pp_ext.runtime.stage import LossRecord

    model, chunk, _, shape = _chunk(1)
    runner = _runner(chunk, 1, None)
    runner.forward((0, 0), torch.randn(shape), forward_step, iter(make_batches(model, 1)), 1, LossRecord())
    runner.backward((0, 0), torch.randn(shape), split=False)
    modules = _doubles(chunk)
    return {
        "queued": [m.wgrad_store.context.qsize() for m in modules],
        "grads": all(m.weight.grad is not None for m in modules),
        "enabled": [m.wgrad_store.enabled for m in modules],
    }


def _meter_sees_te_queue() -> dict:
    """What TE's queue keeps from B until W is counted as live activation memory."""
    from megatron_pp_ext.runtime.memory import ActivationMeter
    from megatron_pp_ext.runtime.stage import LossRecord
    from megatron_pp_ext.runtime.weight_grad import WeightGradStore

    model, chunk, _, shape = _chunk(1)
    meter = ActivationMeter()
    meter.exclude(chunk.parameters())
    runner = _runner(chunk, 1, WeightGradStore(), meter)
    runner.forward((0, 0), torch.randn(shape), forward_step, iter(make_batches(model, 1)), 1, LossRecord())
    after_forward = meter.live
    runner.backward((0, 0), torch.randn(shape), split=True)
    after_b = meter.live
    runner.weight((0, 0))
    return {"after_forward": after_forward, "after_b": after_b, "after_w": meter.live}


def _swap_first_two_ws(schedule, rank: int):
    """``schedule`` with the first two W ops of ``rank`` swapped (valid, but not TE's order)."""
    from megatron_pp_ext.schedule.ir import OpKind

    ranks = [list(ops) for ops in schedule.ranks]
    first, second = [i for i, op in enumerate(ranks[rank]) if op.kind == OpKind.W][:2]
    ranks[rank][first], ranks[rank][second] = ranks[rank][second], ranks[rank][first]
    return schedule.with_ranks(ranks)


def pipeline_worker(rank: int, world: int, names: list[str]) -> dict:
    """Each schedule on TE-double chunks (every rank) against the model without a pipeline; then
    zb-h1 with two W ops swapped, refused before its first op on every rank."""
    from te_double import make_te_doubles

    from megatron_pp_ext.megatron.model import build_chunks_from, build_reference, init_parallel_state
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.runtime.p2p import PipeComm
    from megatron_pp_ext.runtime.reference import reference_step
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model = tiny_model(num_layers=2 * world + 1)
    m = 5  # not a multiple of p; DualPipeV needs 2p
    batches = make_batches(model, m, seed=7)
    torch.manual_seed(1234)
    reference = build_reference(model)
    reference_step(reference, forward_step, iter(batches), m)
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    comm = PipeComm(timeout_s=60)
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    report: dict = {}
    for name in names:
        schedule = generate(name, world, m)
        chunks, names_of = build_chunks_from(reference, model, schedule.placement, rank)
        doubles = sum(make_te_doubles(chunk) for chunk in chunks)
        runtime = PipelineRuntime(chunks, comm, shape, torch.float32)
        runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
        errors = {
            names_of[id(p)]: rel_error(p.grad, ref_grads[names_of[id(p)]])
            for chunk in chunks
            for p in chunk.parameters()
        }
        queued = sum(m.wgrad_store.context.qsize() for chunk in chunks for m in _doubles(chunk))
        report[name] = {"doubles": doubles, "worst": max(errors.values()), "queued": queued}
    swapped = _swap_first_two_ws(generate("zb-h1", world, m), world - 1)
    chunks, _ = build_chunks_from(reference, model, swapped.placement, rank)
    for chunk in chunks:
        make_te_doubles(chunk)
    runtime = PipelineRuntime(chunks, comm, shape, torch.float32)
    report["swapped"] = _error_of(
        lambda: runtime.step(swapped, forward_step, [iter(batches) for _ in chunks]), ValueError
    )
    return report


CHECKS = {
    "split": _split_equals_fused,
    "order": _w_out_of_order,
    "unbuilt": _built_without_deferral,
    "forward": _forward_without_deferral,
    "stale": _stale_queue,
    "no_store": _no_store_runs_te_at_once,
    "meter": _meter_sees_te_queue,
}


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_te_b_then_w_equals_bw(stage: int, fused: bool) -> None:
    result = _run("split", stage, fused)
    assert result["doubles"] > 0
    assert result["max_error"] < 1e-6, result
    assert result["input_error"] < 1e-6, result
    assert result["untouched_in_b"], "B must leave TE's weight gradients to W"
    assert result["queued_after_b"] == [1] * result["doubles"]
    assert result["left"] == [0] * result["doubles"] and result["pending"] == []
    assert result["te_weights_nonzero"]


def test_te_w_out_of_b_order_is_refused() -> None:
    message = _run("order")
    assert "first in, first out" in message and "(0, 0)" in message, message


def test_te_linear_built_without_deferral_is_refused_where_w_runs() -> None:
    message = _run("unbuilt")
    assert "built without delay_wgrad_compute" in message and "defer_te_wgrad=True" in message, message


def test_a_te_queue_left_from_an_earlier_step_is_refused() -> None:
    message = _run("stale")
    assert "still holds 1 deferred weight gradients of an earlier step" in message, message


def test_b_after_a_forward_without_deferral_fails_loudly() -> None:
    message = _run("forward")
    assert "queued 0 weight gradients instead of 1" in message and "forwarding()" in message, message


def test_chunk_without_w_ops_computes_te_weight_gradients_at_once() -> None:
    result = _run("no_store")
    assert result["grads"] and set(result["queued"]) == {0} and set(result["enabled"]) == {False}


def test_activation_meter_counts_what_te_keeps_until_w() -> None:
    result = _run("meter")
    assert result["after_forward"] > result["after_b"] > 0, result
    assert result["after_w"] == 0, result


# ---- the TE-version refusal -------------------------------------------------------------------


def test_te_version_refusal_names_the_version(monkeypatch) -> None:
    from megatron_pp_ext.megatron.layer_spec import te_wgrad_refusal

    stand_in_te_version(monkeypatch, "2.2.0")
    message = te_wgrad_refusal("zb-h1")
    assert message is not None and "from 2.3.0" in message and "this machine has 2.2.0" in message
    assert "--transformer-impl local" in message and "\n" not in message
    stand_in_te_version(monkeypatch, "2.3.0")
    assert te_wgrad_refusal("zb-h1") is None


def test_model_build_sets_deferral_only_for_split_schedules_on_te(monkeypatch) -> None:
    from megatron_pp_ext.megatron import model as model_module

    config = model_module.transformer_config(tiny_model(2))
    assert config.delay_wgrad_compute is False
    stand_in_te_version(monkeypatch, "2.1.0")
    with pytest.raises(ValueError, match="from 2.3.0"):
        model_module.defer_weight_gradients(config)
    stand_in_te_version(monkeypatch, "2.9.0")
    model_module.defer_weight_gradients(config)  # past TransformerConfig's MoE-only assertion
    assert config.delay_wgrad_compute is True


def test_pretrain_gpt_check_refuses_an_old_te_or_tp_overlap_for_split_schedules_only(monkeypatch) -> None:
    """pretrain_gpt.py's check (``pretrain.check_te_wgrad``, run by Megatron's parser): the same
    line as train's for a B/W-split schedule on the TE spec where TE is older than 2.3.0, and
    ``--tp-comm-overlap`` refused with it; nothing where TE does not import (Megatron reports
    that) or for the local spec or 1F1B."""
    import importlib.util
    from types import SimpleNamespace

    from megatron_pp_ext.megatron import pretrain
    from megatron_pp_ext.megatron.hook import OptionError

    zb = SimpleNamespace(name="zb-h1", splits_backward=True)
    one_f_one_b = SimpleNamespace(name="1f1b", splits_backward=False)
    te_args = SimpleNamespace(transformer_impl="transformer_engine")
    local_args = SimpleNamespace(transformer_impl="local")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: object() if name == "transformer_engine" else real_find_spec(name, *rest),
    )
    stand_in_te_version(monkeypatch, "2.2.0")
    with pytest.raises(OptionError) as error:
        pretrain.check_te_wgrad(te_args, zb)
    assert error.value.flag == "--transformer-impl" and "from 2.3.0" in str(error.value)
    pretrain.check_te_wgrad(local_args, zb)
    pretrain.check_te_wgrad(te_args, one_f_one_b)
    assert pretrain.defers_te_wgrad(te_args, zb) and not pretrain.defers_te_wgrad(te_args, one_f_one_b)
    stand_in_te_version(monkeypatch, "2.3.0")
    pretrain.check_te_wgrad(te_args, zb)
    overlap = SimpleNamespace(transformer_impl="transformer_engine", tp_comm_overlap=True)
    with pytest.raises(OptionError) as error:
        pretrain.check_te_wgrad(overlap, zb)
    assert error.value.flag == "--tp-comm-overlap", error.value
    pretrain.check_te_wgrad(overlap, one_f_one_b)
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    assert pretrain.defers_te_wgrad(te_args, zb) is (real_find_spec("transformer_engine") is not None)


# ---- TE's first-in first-out order in the schedules -------------------------------------------


def test_every_split_generator_orders_each_stages_w_like_its_b() -> None:
    """What TE's queue needs (``weight_order_error``), over every generator with a B/W split."""
    from megatron_pp_ext.schedule.generators import SCHEDULES, generate
    from megatron_pp_ext.schedule.validate import weight_order_error

    checked = 0
    for name, spec in sorted(SCHEDULES.items()):
        for pp in (2, 3, 4):
            vpp = spec.allowed_vpp[0] if spec.allowed_vpp else 2
            for slices in (1, 2):
                if slices < spec.min_slices(pp, vpp):
                    continue
                low = spec.min_microbatches(pp, vpp, slices)
                for m in sorted({max(low, pp), max(low, 2 * pp), max(low, 2 * pp + 1)}):
                    schedule = generate(name, pp, m, vpp=vpp, slices=slices)
                    if schedule.splits_backward:
                        assert weight_order_error(schedule) is None, (name, pp, m, slices)
                        checked += 1
    assert checked >= 30


def test_w_out_of_b_order_is_named() -> None:
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.ir import OpKind, Schedule
    from megatron_pp_ext.schedule.validate import weight_order_error

    schedule = generate("zb-h1", 2, 4)
    ranks = [list(ops) for ops in schedule.ranks]
    ws = [i for i, op in enumerate(ranks[1]) if op.kind == OpKind.W]
    first, second = ws[0], ws[1]
    ranks[1][first], ranks[1][second] = ranks[1][second], ranks[1][first]
    swapped = Schedule(**{**vars(schedule), "ranks": ranks})
    error = weight_order_error(swapped)
    assert error is not None and error.startswith("rank 1, stage 1: W of microbatch 1"), error


def test_split_schedules_on_te_doubles_equal_the_model_without_a_pipeline() -> None:
    """Two gloo ranks: ZB-H1, ZB-H2, V-ZB and DualPipeV on chunks whose transformer linears defer
    through (a double of) TE's queue give the unpipelined model's gradients; a W order that is not
    TE's is refused by every rank before the step."""
    names = ["zb-h1", "zb-h2", "v-zb", "dualpipev"]
    reports = check_ok(run_ranks(pipeline_worker, 2, names, timeout=240))
    for rank, report in enumerate(reports):
        for name in names:
            assert report[name]["doubles"] > 0, (rank, name)
            assert report[name]["worst"] < 1e-5, (rank, name, report[name])
            assert report[name]["queued"] == 0, (rank, name)
        assert "first in, first out" in report["swapped"] and "rank 1, stage" in report["swapped"], report
