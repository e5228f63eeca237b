"""Our runtime on one rank: the main job's chunks, forward_step and loss_func, timed one step at a time."""

from __future__ import annotations

import torch
from torch import Tensor

from ..megatron.model import ModelConfig, build_chunks_from
from ..megatron.steps import forward_step
from ..runtime import PipeComm, PipelineRuntime
from ..runtime.offload_probe import offload_ratio_on
from ..schedule.ir import Schedule
from ..schedule.offload import OffloadPolicy, apply_offload


def microbatch_loss(report: Tensor) -> float:
    """A microbatch's mean token loss from the main job's report: ``[sum, tokens]`` (Megatron's
    three-value loss_func) or the mean itself."""
    values = report.detach().reshape(-1).double()
    return float(values[0] / values[1].clamp(min=1)) if values.numel() == 2 else float(values[0])


class ModuleJob:
    """What the bench's worker asks of every job besides its step, over the job's ``modules``
    (this rank's model pieces): clear their gradients, and the sum of their squares."""

    modules: list[torch.nn.Module]

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)

    def grad_square_sum(self) -> float:
        return sum(
            float(param.grad.detach().double().pow(2).sum())
            for module in self.modules
            for param in module.parameters()
            if param.grad is not None
        )


class OurJob(ModuleJob):
    """One rank of one of our schedules, with the weights of ``reference``: the chunks of
    pipeline rank ``comm.rank`` (with expert parallelism the world holds several pipelines). A
    schedule with overlapped pairs (``meta["pairs"]``) runs them; ``pairs`` is how many the last
    step ran on this rank."""

    def __init__(
        self,
        schedule: Schedule,
        model: ModelConfig,
        reference: torch.nn.Module,
        batches: list[dict[str, Tensor]],
        comm: PipeComm,
        micro_batch_size: int,
        auto_offload: bool = False,
    ) -> None:
        self.chunks, _ = build_chunks_from(
            reference, model, schedule.placement, comm.rank, sliced=schedule.slices > 1
        )
        self.modules = list(self.chunks)
        device = next(self.chunks[0].parameters()).device
        self.batches = [{key: value.to(device) for key, value in batch.items()} for batch in batches]
        if auto_offload:  # as train's --pp-offload auto: k from this device's measured throughputs
            ratio = offload_ratio_on(device, model.hidden_size, model.seq_length, model.torch_dtype)
            schedule = apply_offload(schedule, OffloadPolicy("auto", ratio=ratio))
        self.schedule = schedule
        shape = (model.seq_length, micro_batch_size, model.hidden_size)
        self.runtime = PipelineRuntime(self.chunks, comm, shape, model.torch_dtype)
        self.pairs = 0

    def step(self, measure: bool = True) -> tuple[float | None, int | None]:
        """One step; returns (mean microbatch loss on the loss rank else None, activation peak).
        Without ``measure`` the runtime runs without its activation meter (the peak is None), as
        the pretrain_gpt.py hook runs it: timed steps do not pay for the meter's hooks."""
        self.runtime.measure_memory = measure
        iterators = [iter(self.batches) for _ in self.chunks]
        result = self.runtime.step(self.schedule, forward_step, iterators)
        self.pairs = result.pairs
        loss = None
        if result.is_loss_rank:
            loss = sum(microbatch_loss(item["lm loss"]) for item in result.losses) / len(result.losses)
        return loss, result.peak_activation_bytes
