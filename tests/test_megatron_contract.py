"""Megatron's forward-backward contract: each case under megatron-core's schedule and under ours.

Written from megatron-core's own schedule tests (Megatron-LM
``tests/unit_tests/pipeline_parallel/test_schedules.py``: forward-only steps, interleaving with a
``decoder_seq_length`` it ignores, custom process groups, the no-pipelining path with no sizes)
and the contract items of a training step: losses and every gradient through chunks whose last op
saves its own output (``tanh``), ``deallocate_pipeline_outputs`` both ways, the first-microbatch
calls that refresh Transformer Engine's FP8 weights (``first_val_step`` too), the current
microbatch, ``set_input_tensor``'s list, ``collect_non_loss_data``, the sync hooks, the timers,
partial activation checkpoints (the third argument), ``enable_autocast``, variable sequence
lengths (also under NCCL's rules). The stand-in chunks (``contract_model.py``) log what the
schedule did to them; a case runs both schedules in the same gloo processes and the test compares
everything they return. One process group per module (three launches) keeps it quick.
"""

from __future__ import annotations

import functools
from typing import Any

import contract_model as cm
import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import rel_error

WORLD = 2
MEGATRON = "megatron"
REFERENCE = "reference"  # the model without a pipeline (cases megatron-core cannot run on CPU)
WORLD_OF = [WORLD]  # the world size of the worker running (1 for the no-pipelining cases)
TOLERANCE = 1e-5  # float32, sums of at most a few hundred terms in another order


def _config(case: dict) -> Any:
    from megatron.core.transformer import TransformerConfig

    world = WORLD_OF[0]
    config = TransformerConfig(
        num_layers=2 * case.get("stages", world),
        hidden_size=cm.HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=world,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,  # megatron-core's batched p2p crosses messages on gloo at PP 2
        deallocate_pipeline_outputs=case.get("deallocate", True),
        variable_seq_lengths=bool(case.get("lengths")),
        moe_token_dispatcher_type="alltoall",  # TransformerConfig refuses variable lengths otherwise
        num_microbatches_with_partial_activation_checkpoints=case.get("partial"),
        enable_autocast=case.get("autocast", False),
        autocast_dtype=torch.bfloat16,
    )
    if case.get("seq_length", cm.SEQ) is None:  # the no-pipelining path needs no width
        config.hidden_size = None
    config.calculate_per_token_loss = False
    config.timers = cm.Timers()
    sync = cm.SyncLog()
    config.no_sync_func = sync.no_sync
    config.grad_sync_func = sync.grad_sync
    config.sync_log = sync
    return config


def _run(rank: int, case: dict, pg_collection: Any = None, p2p_communicator: Any = None) -> dict:
    """One step of ``case`` on this rank: megatron-core's schedule or ours (through the hook)."""
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from megatron_pp_ext.megatron import hook

    world = WORLD_OF[0]
    stages, microbatches = case.get("stages", world), case["microbatches"]
    config = _config(case)
    side = case["side"]
    if side == REFERENCE:
        return _reference(rank, case, config) if rank == 0 else {"outputs": [], "grads": {}, "events": {}}
    if side == MEGATRON:
        chunks_per_rank = stages // world
        if chunks_per_rank > 1:
            config.virtual_pipeline_model_parallel_size = chunks_per_rank
            config.microbatch_group_size_per_vp_stage = world
            function = schedules.forward_backward_pipelining_with_interleaving
        elif world == 1:
            function = schedules.forward_backward_no_pipelining
        else:
            function = schedules.forward_backward_pipelining_without_interleaving
        mine = [c * world + rank for c in range(chunks_per_rank)]
    else:
        installed = hook.install(
            schedule=side,
            p2p_timeout=60,
            emulate_nccl=case.get("emulate_nccl", False),
            chunks=case.get("chunks"),
            slices=case.get("slices", 1),
        )
        placement = installed.schedule(world, microbatches).placement
        mine = sorted(placement.stages_of(rank), key=placement.chunk_index)
        function = pipeline_parallel.get_forward_backward_func()
    chunks = [cm.StandInStage(config, stage, stages) for stage in mine]
    data = cm.batches(microbatches, case.get("lengths"))
    kwargs = dict(
        forward_step_func=cm.forward_step_checkpoints if case.get("partial") is not None else cm.forward_step,
        data_iterator=[iter(data) for _ in chunks] if len(chunks) > 1 else iter(data),
        model=chunks,
        num_microbatches=microbatches,
        seq_length=case.get("seq_length", cm.SEQ),
        micro_batch_size=case.get("micro_batch_size", cm.MICRO_BATCH),
        decoder_seq_length=case.get("decoder_seq_length"),
        forward_only=case.get("forward_only", False),
        collect_non_loss_data=case.get("collect_non_loss_data", False),
        first_val_step=case.get("first_val_step"),
    )
    if case.get("adjust"):
        kwargs["adjust_tensor_shapes_fn"] = lambda recv, send: (recv, send)
    if pg_collection is not None:
        kwargs.update(pg_collection=pg_collection, p2p_communicator=p2p_communicator)
    try:
        outputs = function(**kwargs)
    except Exception as error:  # the refusal cases: what the rank says
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        if side != MEGATRON:
            hook.uninstall()
    return {
        "outputs": [_plain(item) for item in outputs],
        "grads": {
            f"{chunk.stage}.{name}": param.grad.numpy().copy()  # numpy: pickled by value
            for chunk in chunks
            for name, param in chunk.named_parameters()
            if param.grad is not None
        },
        "events": {chunk.stage: chunk.events for chunk in chunks},
        "starts": dict(config.timers.starts),
        "stops": dict(config.timers.stops),
        "levels": config.timers.levels,
        "sync": dict(config.sync_log.calls),
    }


def _reference(rank: int, case: dict, config: Any) -> dict:
    """The model without a pipeline: every stage in this process, one microbatch at a time, the
    loss normalised as Megatron's ``forward_step_calc_loss`` does (for the cases megatron-core's
    schedules cannot run on CPU: variable lengths exchange shapes through CUDA)."""
    stages, microbatches = case.get("stages", WORLD_OF[0]), case["microbatches"]
    chunks = [cm.StandInStage(config, stage, stages) for stage in range(stages)]
    outputs = []
    for batch in cm.batches(microbatches, case.get("lengths")):
        hidden = None
        for chunk in chunks:
            chunk.set_input_tensor([hidden])
            hidden = chunk(batch["tokens"], batch["labels"])
        total, tokens, report = cm.loss_func(hidden)
        (total / tokens / microbatches).backward()
        outputs.append(_plain(report))
    grads = {f"{c.stage}.{n}": p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters()}
    return {"outputs": outputs, "grads": grads, "events": {}}


def _plain(item: Any) -> Any:
    if isinstance(item, dict):
        return {key: _plain(value) for key, value in item.items()}
    if isinstance(item, torch.Tensor):
        return item.detach().double().tolist()
    return item


def parallel_state_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case with Megatron's global parallel state (PP = ``world``)."""
    from megatron.core import parallel_state

    from megatron_pp_ext.megatron import cpu_shim

    cpu_shim.install_for_schedules()  # megatron-core's schedules count tokens on "cuda"
    WORLD_OF[0] = world
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    return [_run(rank, case) for case in cases]


def custom_groups_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """The cases with megatron-core's custom process groups and no global parallel state."""
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_pp_ext.megatron import cpu_shim

    cpu_shim.install_for_schedules()
    assert not parallel_state.model_parallel_is_initialized()
    grid = HyperCommGrid([1, 1, world, 1], ["tp", "cp", "pp", "dp"])
    pg = ProcessGroupCollection()
    pg.tp, pg.cp, pg.pp = grid.create_pg("tp"), grid.create_pg("cp"), grid.create_pg("pp")
    pg.dp_cp = grid.create_pg(["dp", "cp"])
    pg.embd = pg.pos_embd = None
    results = []
    for case in cases:
        p2p = P2PCommunicator(pp_group=pg.pp, config=_config(case))
        results.append(_run(rank, case, pg, p2p))
    return results


# -- the cases --------------------------------------------------------------------------------

TRAIN_2 = {"microbatches": 3}  # two stages, m not a multiple of p
TRAIN_4 = {"stages": 4, "microbatches": 4}  # two chunks per rank
VARIABLE = {"microbatches": 3, "lengths": [8, 5, 7]}
CASES: dict[str, dict] = {
    "train": TRAIN_2,
    "train-kept-outputs": {**TRAIN_2, "deallocate": False},
    "train-chunks": TRAIN_4,
    "decoder-seq-length": {**TRAIN_4, "decoder_seq_length": 4},  # interleaved ignores it
    "forward-only": {"microbatches": 3, "forward_only": True},
    "first-val-step-true": {"microbatches": 3, "forward_only": True, "first_val_step": True},
    "first-val-step-false": {"microbatches": 3, "forward_only": True, "first_val_step": False},
    "non-loss-data": {"microbatches": 3, "forward_only": True, "collect_non_loss_data": True},
    "non-loss-data-chunks": {**TRAIN_4, "forward_only": True, "collect_non_loss_data": True},
    "partial-checkpoints": {"microbatches": 5, "partial": 1},
}
# our schedules that each case runs, beside megatron-core's
OURS = {
    "train": ["1f1b", "zb-h1", "zb-h2"],
    "train-kept-outputs": ["1f1b", "zb-h1"],
    "train-chunks": ["interleaved-1f1b", "v-zb", "dualpipev"],
    "decoder-seq-length": ["interleaved-1f1b"],
    "forward-only": ["1f1b", "zb-h1"],
    "first-val-step-true": ["1f1b"],
    "first-val-step-false": ["1f1b"],
    "non-loss-data": ["1f1b"],
    "non-loss-data-chunks": ["v-half"],
    "partial-checkpoints": ["1f1b"],
}
ONLY_OURS = {
    "variable": {**VARIABLE, "side": REFERENCE},
    "variable-1f1b": {**VARIABLE, "side": "1f1b"},
    "variable-zb-h1": {**VARIABLE, "side": "zb-h1"},
    "variable-nccl": {**VARIABLE, "side": "zb-h1", "emulate_nccl": True},
    "autocast": {**TRAIN_2, "side": "1f1b", "autocast": True},
    "adjust-shapes": {**TRAIN_2, "side": "1f1b", "adjust": True},
    "variable-sliced": {**VARIABLE, "side": "seq1f1b", "slices": 2, "seq_length": 16},  # refused first
    # last: a failed step leaves messages behind
    "variable-too-long": {"microbatches": 2, "lengths": [8, 12], "side": "1f1b"},
}


def _all_cases() -> list[dict]:
    runs = []
    for name, case in CASES.items():
        runs.append({**case, "name": name, "side": MEGATRON})
        runs += [{**case, "name": name, "side": ours} for ours in OURS[name]]
    runs += [{**case, "name": name} for name, case in ONLY_OURS.items()]
    return runs


@functools.cache
def _results() -> dict[tuple[str, str], list[dict]]:
    """(case, side) -> the result of each rank, from one launch of the worker."""
    runs = _all_cases()
    per_rank = check_ok(run_ranks(parallel_state_worker, WORLD, runs, timeout=300))
    return {(run["name"], run["side"]): [ranks[i] for ranks in per_rank] for i, run in enumerate(runs)}


def _merged(results: list[dict], key: str) -> dict:
    merged: dict = {}
    for result in results:
        merged.update(result[key])
    return merged


def _losses(results: list[dict]) -> list[Any]:
    return [item for result in results for item in result["outputs"]]


def _close(ours: Any, theirs: Any, what: str) -> None:
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), what
        for key in theirs:
            _close(ours[key], theirs[key], f"{what}[{key}]")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), what
        for index, (a, b) in enumerate(zip(ours, theirs)):
            _close(a, b, f"{what}[{index}]")
    else:
        assert abs(ours - theirs) <= TOLERANCE * max(1.0, abs(theirs)), f"{what}: {ours} vs {theirs}"


def _grads_close(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name, reference in theirs.items():
        error = rel_error(torch.as_tensor(ours[name]), torch.as_tensor(reference))
        assert error <= TOLERANCE, f"{what}: gradient of {name} off by {error:.2e}"


def _logged(events: dict[int, list[tuple]], kind: str) -> dict[int, list]:
    """Per stage: the value of each ``kind`` event a chunk logged."""
    return {stage: [e[1] for e in log if e[0] == kind] for stage, log in events.items()}


def _forwards(results: list[dict]) -> dict[int, list[tuple]]:
    """Per stage: (current microbatch, first-microbatch call before it) of each forward."""
    events = _merged(results, "events")
    return {stage: [e[1:] for e in log if e[0] == "forward"] for stage, log in events.items()}


def _pairs() -> list[tuple[str, str]]:
    return [(name, ours) for name in CASES for ours in OURS[name]]


@pytest.mark.parametrize(("case", "ours"), _pairs())
def test_same_answers_as_megatron(case: str, ours: str) -> None:
    """Loss dicts (or non-loss data) on the pipeline's ranks and every gradient equal
    megatron-core's, and each chunk saw the same forwards: the current microbatch and the
    first-microbatch call (FP8 weight refresh) before the same ones, ``set_input_tensor`` with a
    list every time."""
    theirs, mine = _results()[(case, MEGATRON)], _results()[(case, ours)]
    for result in theirs + mine:
        assert "error" not in result, result.get("error")
    _close(_losses(mine), _losses(theirs), f"{case} {ours}: outputs")
    assert _losses(theirs), "megatron-core returned no losses: nothing was compared"
    if not CASES[case].get("forward_only"):
        _grads_close(_merged(mine, "grads"), _merged(theirs, "grads"), f"{case} {ours}")
        assert _merged(theirs, "grads")
    assert _forwards(mine) == _forwards(theirs)
    events = _merged(mine, "events")
    assert all(all(values) for values in _logged(events, "input-is-list").values())
    if case == "partial-checkpoints":
        reference = _logged(_merged(theirs, "events"), "checkpoint")
        assert _logged(events, "checkpoint") == reference and any(True in v for v in reference.values())


def test_first_microbatch_calls_follow_first_val_step() -> None:
    """What the comparison above holds to, stated: a training step refreshes each chunk's FP8
    weights before its microbatch 0 only; forward-only steps do unless first_val_step is False."""
    for case, expected in (("train", True), ("first-val-step-true", True), ("first-val-step-false", False)):
        for stage, forwards in _forwards(_results()[(case, "1f1b")]).items():
            assert forwards == [(mb, mb == 0 and expected) for mb in range(len(forwards))], (case, stage)
    for stage, forwards in _forwards(_results()[("train-chunks", "v-zb")]).items():
        assert [first for _, first in forwards] == [True] + [False] * (len(forwards) - 1), stage


@pytest.mark.parametrize("ours", ["1f1b", "interleaved-1f1b"])
def test_timers_and_sync_hooks_as_megatron(ours: str) -> None:
    """Megatron's timer names and levels, started and stopped as often as its schedule does; the
    DDP sync hooks balanced, each chunk's grad_sync_func called once."""
    case = "train" if ours == "1f1b" else "train-chunks"
    theirs, mine = _results()[(case, MEGATRON)], _results()[(case, ours)]
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        assert a["starts"] == a["stops"], f"rank {rank}: {a['starts']} started, {a['stops']} stopped"
        for name in ("forward-backward", "forward-compute", "backward-compute"):
            assert a["starts"][name] == b["starts"][name] > 0, (rank, name)
            assert a["levels"][name] == b["levels"][name], (rank, name)
        p2p = {n for n in a["starts"] if n.endswith(("-send", "-recv"))}
        assert p2p and all(b["levels"].get(n, a["levels"][n]) == a["levels"][n] == 2 for n in p2p)
        # each chunk's reduction starts once, after its last weight gradient, by grad_sync_func;
        # megatron-core's 1F1B lets DDP's hooks start rank 0's in its last backward instead
        chunks = 1 if ours == "1f1b" else 2
        assert a["sync"] == {"no_sync enter": 1, "no_sync exit": 1, "grad_sync": chunks}, (rank, a["sync"])
        assert b["sync"]["no_sync enter"] == b["sync"]["no_sync exit"]


def test_split_schedules_time_weight_passes_as_backward_compute() -> None:
    for rank, result in enumerate(_results()[("train", "zb-h1")]):
        microbatches = CASES["train"]["microbatches"]
        assert result["starts"]["forward-compute"] == microbatches
        assert result["starts"]["backward-compute"] == 2 * microbatches, rank  # B and W


def test_stage_output_saved_by_autograd_is_exact_with_the_activation_meter_on() -> None:
    """hook.install(schedule=...) without Megatron-LM's args counts activations with saved-tensor
    hooks, and the sent output of a stage ending in tanh is freed: the gradients of the first
    stage (behind the freed output) still equal megatron-core's, in both deallocation modes."""
    for case in ("train", "train-kept-outputs"):
        theirs = _merged(_results()[(case, MEGATRON)], "grads")
        mine = _merged(_results()[(case, "zb-h1")], "grads")
        first = {name: grad for name, grad in theirs.items() if name.startswith("0.")}
        assert first
        _grads_close({name: mine[name] for name in first}, first, case)


def test_variable_lengths_equal_the_unpipelined_model_also_under_nccl_rules() -> None:
    """``variable_seq_lengths``: microbatches of 8, 5 and 7 tokens under 1F1B and ZB-H1 (and under
    NCCL's rules) give the unpipelined model's losses and gradients."""
    reference = _results()[("variable", REFERENCE)]
    assert _losses(reference) and _merged(reference, "grads")
    for case in ("variable-1f1b", "variable-zb-h1", "variable-nccl"):
        mine = _results()[(case, ONLY_OURS[case]["side"])]
        for result in mine:
            assert "error" not in result, result["error"]
        _close(_losses(mine), _losses(reference), case)
        _grads_close(_merged(mine, "grads"), _merged(reference, "grads"), case)


def test_variable_length_longer_than_seq_length_is_named_on_both_ranks() -> None:
    errors = [result.get("error", "") for result in _results()[("variable-too-long", "1f1b")]]
    assert all("variable_seq_lengths" in e and "seq_length" in e and "(12, 2, 8)" in e for e in errors), (
        errors
    )


def test_variable_lengths_with_slices_are_refused_in_one_line() -> None:
    for result in _results()[("variable-sliced", "seq1f1b")]:
        error = result.get("error", "")
        assert "variable_seq_lengths" in error and "sequence slices" in error and "\n" not in error, error


def test_enable_autocast_runs_the_forward_under_autocast_on_the_chunks_device() -> None:
    """megatron-core enters ``torch.autocast("cuda")`` (a no-op on CPU); ours enters it on the
    chunk's device, so a CPU run computes in autocast_dtype as a GPU run would."""
    for result in _results()[("autocast", "1f1b")]:
        assert "error" not in result, result.get("error")
        flags = [flag for values in _logged(result["events"], "autocast").values() for flag in values]
        assert flags and all(flags)
    plain = _merged(_results()[("train", "1f1b")], "events")
    assert not any(any(values) for values in _logged(plain, "autocast").values())


def test_adjust_tensor_shapes_fn_is_refused_in_one_line() -> None:
    for result in _results()[("adjust-shapes", "1f1b")]:
        assert "adjust_tensor_shapes_fn" in result["error"] and "\n" not in result["error"]


def test_custom_process_groups_without_parallel_state() -> None:
    """megatron-core's ``pg_collection`` and ``p2p_communicator`` with no global parallel state:
    ours runs on those groups and gives megatron-core's answers (as its schedule test compares its
    own schedule with and without them)."""
    runs = [{**TRAIN_2, "name": "pg", "side": side} for side in (MEGATRON, "1f1b", "zb-h1")]
    per_rank = check_ok(run_ranks(custom_groups_worker, WORLD, runs, timeout=180))
    results = {run["side"]: [ranks[i] for ranks in per_rank] for i, run in enumerate(runs)}
    theirs = results[MEGATRON]
    for ours in ("1f1b", "zb-h1"):
        for result in results[ours]:
            assert "error" not in result, result["error"]
        _close(_losses(results[ours]), _losses(theirs), ours)
        _grads_close(_merged(results[ours], "grads"), _merged(theirs, "grads"), ours)
    assert _losses(theirs)


def test_pipeline_size_one_needs_no_sizes() -> None:
    """Megatron's no-pipelining path takes ``seq_length=None`` and ``micro_batch_size=None`` and
    a config without ``hidden_size``; so does ours at PP 1."""
    runs = [
        {
            "name": "pp1",
            "side": side,
            "stages": 1,
            "microbatches": 3,
            "seq_length": None,
            "micro_batch_size": None,
        }
        for side in (MEGATRON, "1f1b")
    ]
    per_rank = check_ok(run_ranks(parallel_state_worker, 1, runs, timeout=120))
    theirs, mine = per_rank[0]
    assert "error" not in mine, mine.get("error")
    _close(mine["outputs"], theirs["outputs"], "pp1")
    _grads_close(mine["grads"], theirs["grads"], "pp1")
