"""One process's part of a training run, in levels as torchtitan lays out its trainer:

* :meth:`TrainJob.run` iterates: data, the iterations, and after each one validation, logging,
  checkpoint and the stop check (:meth:`TrainJob._after_step`);
* :meth:`TrainJob.train_step` is one iteration: the pipeline step, then the optimizer step
  (:mod:`optimizer_steps`, which also knows when a step is checked under post-validation);
* :meth:`TrainJob.forward_backward` is one global batch through the schedule, by Megatron's
  ``get_forward_backward_func()``, which the installed hook answers with the runtime's schedule.

The model, optimizer, data and output are built by their own modules (``model.py``,
``optimizer_steps.py``, ``data.py``, ``metrics.py``); the job holds them and the position (the
iteration it is at, the samples consumed), which checkpoints record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, pipeline_parallel

from .. import launch
from ..logs import Logs
from ..megatron import cpu_shim, install
from ..megatron.checkpoint import TrainingCheckpoint, find_checkpoint, iteration_dir
from ..megatron.hook import run_shape
from ..megatron.model import split_layers
from ..megatron.optimizer import StepInfo
from ..megatron.steps import forward_step
from ..stop import StopRequest
from .data import TrainData
from .metrics import RankFigures, TrainLog, report_ranks
from .model import build_model, init_parallel, layer_list, model_config
from .optimizer_steps import build_optimizer_steps
from .profiler import pytorch_profiler
from .settings import TrainSettings, learning_rate, scheduler_state

Row = dict[str, Any]


class TrainJob:
    """One process's part of a training run: its model chunks in DDP, the optimizer, the data
    iterators, the checkpoint, and the iteration it is at."""

    def __init__(
        self, rank: int, settings: TrainSettings, device: Any, forward_step_func: Callable[..., Any] | None
    ) -> None:
        self.rank, self.settings, self.device = rank, settings, device
        self.forward_step_func = forward_step_func or forward_step
        self.stop: StopRequest | None = None
        self.phase = "start-up"  # what the run is doing, for the line a fault prints
        self.vocab: Any = None
        cpu_shim.install()  # no-op with CUDA
        init_parallel(settings)
        self.hook = install(options=settings.pipeline)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        settings = self.settings
        self.model_config = model_config(settings)
        self.hook.model = self.model_config.shape()  # the run's costs order its schedule
        self.hook.layers = settings.layers_per_stage  # and its layers per stage (Megatron's split flags)
        run = run_shape(self.hook.model, self.model_config.seq_length, settings.layers_per_stage)
        self.schedule = self.hook.schedule(settings.pp, settings.microbatches, run)  # as the steps run it
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        # Losses are reported per CP rank (its own tokens): summed over DP x CP. Data goes by DP rank.
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.model, self.vocab = build_model(settings, self.model_config, self.schedule, pipeline_rank)
        if self.vocab is not None:
            self.hook.vocab = self.vocab
        bf16 = self.model_config.dtype == "bfloat16"
        self.steps = build_optimizer_steps(self.model, settings, self.schedule, bf16, self.device)
        self.optimizer = self.steps.optimizer
        self.steps.install(self.hook)
        self.checkpoint = TrainingCheckpoint(
            self.model,
            self.optimizer,
            self.schedule.placement.stages_of(pipeline_rank),
            split_layers(self.model_config.num_layers, self.schedule.num_stages, layer_list(settings)),
            layout=checkpoint_layout(settings, self.schedule),
        )
        self.data = TrainData(settings, self.model_config.seq_length, self.dp_rank, len(self.model))
        self.is_loss_rank = self.schedule.loss_rank == pipeline_rank
        shows = (
            self.is_loss_rank and self.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
        )
        self.shows = shows and parallel_state.get_context_parallel_rank() == 0
        self.log: TrainLog  # run() opens it: the bar, --metrics and --tensorboard-dir
        # where the run is: what a checkpoint records besides the tensors
        self.position = {"iteration": 0, "consumed_train_samples": 0, "skipped_iterations": 0}
        self.figures = RankFigures()

    def say(self, message: str) -> None:
        if self.shows:
            print(message, flush=True)

    def resume(self) -> None:
        """``--load``: the checkpoint's tensors, RNG and position (iteration, data)."""
        settings = self.settings
        if settings.load is None:
            return
        path = find_checkpoint(settings.load, settings.ckpt_step)
        if path is None:
            self.say(f"no checkpoint in {settings.load}: starting from scratch")
            return
        loaded = self.checkpoint.load(path, settings.load_optimizer, settings.load_rng)
        self.position = {key: int(loaded.get(key, value)) for key, value in self.position.items()}
        rng = "" if loaded["rng_restored"] else " (RNG states not restored: another layout)"
        self.say(
            f"loaded {path} at iteration {self.position['iteration']}, written by "
            f"{_describe(loaded.get('layout', {}))}{rng}"
        )

    # ---- the iterations ---------------------------------------------------------------------

    def run(self) -> list[Row]:
        """Train from the position to ``--train-iters``; the per-iteration rows (the loss where
        it is reported, None elsewhere)."""
        settings = self.settings
        iterators = self.data.iterators("train", self.position["consumed_train_samples"])
        first = self.position["iteration"] + 1
        valid_iterators = None
        if settings.eval_interval is not None:  # as Megatron-LM: on from the validations done
            done = (first - 1) // settings.eval_interval * settings.eval_iters * settings.iteration_samples()
            valid_iterators = self.data.iterators("valid", done)
        self.log = TrainLog(settings, self.shows, first)
        rows: list[Row] = []
        began = time.perf_counter()
        profiler = pytorch_profiler(settings)
        for iteration in range(first, settings.iterations + 1):
            row, step = self.train_step(iteration, iterators, began)
            if profiler is not None:
                profiler.step()
            for picture in self.hook.flush_timelines():  # after the window, outside its steps
                self.log.write(f"--pp-timeline: wrote {self.settings.pipeline.timeline} and {picture}")
            rows.append(row)
            saved = self._after_step(row, step, valid_iterators)
            if self.stop is not None and iteration < settings.iterations and self._stopped(iteration, saved):
                break
        if profiler is not None:
            profiler.stop()
        if self.stop is not None:
            self.stop.finish()
        self.log.close()
        return rows

    def train_step(self, iteration: int, iterators: list[Any], began: float) -> tuple[Row, StepInfo]:
        """One iteration: the pipeline step, then the optimizer step. Returns its row and the
        optimizer step (:meth:`_after_step` completes the row once the step is checked)."""
        settings = self.settings
        if self.steps.begin(iteration):
            self.phase = f"the barrier that starts iteration {iteration} (every rank)"
            dist.barrier()  # every rank starts together: comparable step times
        start = time.perf_counter()
        self.phase = f"the pipeline step of iteration {iteration}"
        losses = self.forward_backward(iterators, forward_only=False)
        held = self.steps.release()  # post-validation: the previous row, checked at this step's gate
        if held is not None:
            self._emit(*held)
        changed = self.steps.timed(time.perf_counter() - start)  # post-validation's chain, measured
        if changed is not None:
            self.log.write(changed)
        self.phase = f"the optimizer step of iteration {iteration} (gradients over the data-parallel ranks)"
        step = self.steps.step(learning_rate(settings, iteration))
        elapsed = time.perf_counter() - start
        self.figures.measure(self.hook, elapsed)
        self.position["iteration"] = iteration
        self.position["consumed_train_samples"] += settings.iteration_samples()
        loss = self._global_loss(losses) if self.is_loss_rank else None
        row = {
            "iteration": iteration,
            "samples": self.position["consumed_train_samples"],
            "learning_rate": learning_rate(settings, iteration),
            "batch_size": settings.iteration_samples(),
            "loss": loss if self.shows else None,
            "step_time": elapsed,
            "wall_time": time.perf_counter() - began,  # this rank's clock since the first iteration
            "offloaded_bytes": self.figures.offloaded,
            "restarted": self.hook.last_result.restarted,
        }
        return row, step

    def forward_backward(self, iterators: list[Any], forward_only: bool) -> list[Any]:
        """One global batch through the schedule, by Megatron's ``get_forward_backward_func()``
        (the installed hook): the loss dicts on the loss rank."""
        return pipeline_parallel.get_forward_backward_func()(
            forward_step_func=self.forward_step_func,
            data_iterator=iterators,
            model=self.model,
            num_microbatches=self.settings.microbatches,
            seq_length=self.model_config.seq_length,
            micro_batch_size=self.settings.micro_batch_size,
            forward_only=forward_only,
        )

    def _after_step(self, row: Row, step: StepInfo, valid_iterators: list[Any] | None) -> bool:
        """Validate, log and checkpoint after an iteration; whether it saved."""
        settings = self.settings
        iteration = row["iteration"]
        # as Megatron-LM: every --save-interval iterations, and always the last one
        save = settings.save is not None and (
            iteration == settings.iterations
            or bool(settings.save_interval and iteration % settings.save_interval == 0)
        )
        validate = valid_iterators is not None and iteration % settings.eval_interval == 0
        if validate:
            self.steps.settle()  # the validation sees the checked step's weights
            self.phase = f"the validation after iteration {iteration}"
            row["validation_loss"] = self.evaluate(valid_iterators)
        # a checkpoint (or the run's end) takes the checked step
        checked = self.steps.ready(row, step, settle_now=save or validate or iteration == settings.iterations)
        if checked is not None:
            self._emit(row, checked)
        if save:
            self.save()
        return save

    def evaluate(self, iterators: list[Any]) -> float | None:
        """Megatron-LM's ``evaluate``: --eval-iters forward-only steps through the schedule, the
        loss token-weighted over all of them and the data-parallel ranks (on the loss rank)."""
        sums = torch.zeros(2, dtype=torch.float64)
        for _ in range(self.settings.eval_iters):
            losses = self.forward_backward(iterators, forward_only=True)
            if self.is_loss_rank:
                step = torch.stack([sum(item["lm loss"][i] for item in losses) for i in (0, 1)])
                sums += step.detach().double().cpu()
        if not self.is_loss_rank:
            return None
        sums = sums.to(launch.collective_device(self.device))
        dist.all_reduce(sums, group=self.dp_group)
        return float(sums[0] / sums[1])

    def _emit(self, row: Row, step: StepInfo) -> None:
        """Complete an iteration's row with its checked optimizer step; show and record it."""
        row.update(
            grad_norm=step.grad_norm,
            skipped=step.skipped,
            optimistic=step.optimistic,
            rolled_back=step.rolled_back,
        )
        self.position["skipped_iterations"] += int(step.skipped)
        self.log.iteration(row, step, self.position["skipped_iterations"])

    def _stopped(self, iteration: int, saved: bool) -> bool:
        """At an iteration's end: whether a signal asked any rank to stop (all ranks agree, one
        iteration later: ``stop.py``); if so, save (unless this iteration just did) and say how to
        resume."""
        assert self.stop is not None
        self.phase = f"the stop check at the end of iteration {iteration} (every rank)"
        comm = self.hook.comm
        name = self.stop.agreed(launch.collective_device(self.device), comm.launch if comm else None)
        if name is None:
            return False
        settings = self.settings
        if settings.save is not None and not saved:
            self.steps.settle()
            self.save()
        if settings.save is not None:
            where = (
                f"saved {iteration_dir(settings.save, iteration)}; resume with the same command "
                f"and --load {settings.save}"
            )
        else:
            where = "nothing saved (no --save)"
        self.log.write(f"stopped by {name} after iteration {iteration}: {where}")
        return True

    def save(self) -> None:
        self.phase = f"saving the checkpoint of iteration {self.position['iteration']}"
        start = time.perf_counter()
        common = {**self.position, "opt_param_scheduler": scheduler_state(self.settings)}
        path = self.checkpoint.save(self.settings.save, self.position["iteration"], common)
        self.log.write(f"saved {path} in {time.perf_counter() - start:.2f}s")

    def _global_loss(self, losses: list[Any]) -> float:
        """The loss of the whole global batch: token-weighted over the data-parallel ranks."""
        sums = torch.stack([sum(item["lm loss"][i] for item in losses) for i in (0, 1)]).double()
        dist.all_reduce(sums, group=self.dp_group)
        return float(sums[0] / sums[1])

    # ---- the end ----------------------------------------------------------------------------

    def report(self) -> None:
        """Every rank's steady-state figures (printed on rank 0), and to TensorBoard."""
        if self.figures.step_times:
            rows = report_ranks(self.rank, self.settings, self.schedule, self.figures, self.device)
            if self.rank == 0 and self.settings.tensorboard_dir is not None:
                logs = Logs(self.settings.tensorboard_dir)
                logs.ranks(self.position["iteration"], rows)
                logs.close()

    def close(self) -> None:
        if self.vocab is not None:
            self.vocab.vp.close()
        self.hook.uninstall()
        parallel_state.destroy_model_parallel()


def checkpoint_layout(settings: TrainSettings, schedule: Any) -> dict[str, Any]:
    """What wrote a checkpoint: schedule, parallel sizes (RNG states are restored only under the
    same) and model (a load of another model's checkpoint is refused before start)."""
    return {
        "schedule": schedule.name,
        "vpp": schedule.vpp,
        "slices": schedule.slices,
        "parallel": {"pp": settings.pp, "tp": settings.tp, "cp": settings.cp, "dp": settings.dp},
        "model": dict(settings.model),
    }


def _describe(layout: dict[str, Any]) -> str:
    sizes = " ".join(f"{key}={value}" for key, value in layout.get("parallel", {}).items())
    return f"{layout.get('schedule', 'an unknown schedule')} {sizes}".strip()
