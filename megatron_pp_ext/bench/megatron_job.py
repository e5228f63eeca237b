"""Megatron-core's own pipeline schedules on the same chunks, data and microbatches as ours.

``forward_backward_pipelining_without_interleaving`` (1F1B) and ``..._with_interleaving``
(interleaved 1F1B) run as Megatron-LM's training loop runs them, on chunks built exactly as our
runtime's (the same ``GPTModel`` stages, weights copied from one reference) with the main job's
``forward_step`` and ``loss_func``. Settings that differ from a plain Megatron-LM run, and why:

* ``batch_p2p_comm=False``: with batched sends Megatron's interleaved schedule gives a wrong loss
  on gloo at PP 2, where the previous and the next rank are the same peer;
* ``deallocate_pipeline_outputs=True``: as our runtime (and Megatron-LM's default with PP);
* interleaving: the chunks are GPTModels built for one pipeline rank each, so the virtual size
  and ``microbatch_group_size_per_vp_stage`` (Megatron-LM's default, the pipeline size) are set
  on the config the schedule reads, and during the step in Megatron's parallel state, as
  Megatron-LM initialises it (:func:`virtual_pipeline`): combined 1F1B finds the chunk whose
  output goes to the loss there.

On CPU ``megatron.cpu_shim.install_for_schedules`` keeps the schedules' token counter off CUDA.
With ranks sharing a GPU (``--distributed-backend gloo``) Megatron's messages are staged through
host memory (``megatron/gloo_on_gpu.py``), as our runtime stages its own. With ``pair.offload_modules`` the
chunks are built with megatron-core's fine-grained activation offloading of those modules (CUDA and
Transformer Engine only; ``bench`` checks both before it starts).

With ``pair.overlap`` it is megatron-core's combined 1F1B: its interleaved schedule with
``overlap_moe_expert_parallel_comm`` (``pipeline_parallel/combined_1f1b.py``), each F&B of the
steady state one unit through the model's schedule plan, as our paired schedules run theirs. Two
settings differ from Megatron-LM's: megatron-core's ``TransformerConfig`` asserts bf16 or fp16
for that field at construction, so it is set after construction on every chunk's config: the
bench's chunks are fp32 (the combined schedule and the plan's nodes read no dtype field; their
one cast, the loss's ``float16_to_fp32``, leaves fp32 as it is); and on CPU
``cpu_shim.install`` gives the schedule and the plan host streams and events,
where its communication nodes run in line, not beside the other microbatch's compute (its overlap
needs CUDA streams; ours runs them on a thread), so on CPU its time shows the plan's cost, not
its overlap.

With expert parallelism the world holds several pipelines: the chunks are those of this rank's
pipeline rank in Megatron's parallel state, whose pipeline group Megatron's schedules talk over.

Activation bytes are what autograd saves during the step (``saved_tensors_hooks``, by storage,
parameters excluded): the received input is saved by the chunk's first layer and outputs are
freed once sent, so nothing else stays alive. Our runtime also counts the tensors it stashes
(outputs waiting for their send, gradients in flight), so on the same schedule ours reads a little
higher for the same memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..megatron.model import ModelConfig, build_chunks_from
from ..megatron.steps import forward_step
from ..runtime import ActivationMeter
from ..schedule.ir import Placement
from .job import MegatronPair
from .our_job import ModuleJob, microbatch_loss


class MegatronJob(ModuleJob):
    """One rank of one of megatron-core's schedules, with the weights of ``reference``."""

    def __init__(
        self,
        pair: MegatronPair,
        model: ModelConfig,
        reference: torch.nn.Module,
        batches: list[dict[str, Tensor]],
        pp: int,
        micro_batch_size: int,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules

        from ..megatron import cpu_shim, gloo_on_gpu

        cpu_shim.install_for_schedules()  # nothing with CUDA (the schedule plan's streams too)
        if pair.offload_modules:  # read by the layers as they are built
            fields = dict(
                fine_grained_activation_offloading=True,
                offload_modules=list(pair.offload_modules),
                min_offloaded_tensor_size=pair.min_offloaded_tensor_size,
            )
            model = dataclasses.replace(model, extra={**model.extra, **fields})
        # Megatron's chunk c on rank r is stage c*p + r
        placement = Placement(pp, pp * pair.chunks, "interleaved")
        rank = parallel_state.get_pipeline_model_parallel_rank()
        self.chunks, _ = build_chunks_from(reference, model, placement, rank)
        device = next(self.chunks[0].parameters()).device
        if device.type != "cpu" and dist.get_backend() == "gloo":  # ranks sharing a GPU
            gloo_on_gpu.install_for_p2p()
        self.batches = [{key: value.to(device) for key, value in batch.items()} for batch in batches]
        config = self.chunks[0].config  # the one Megatron's schedules read (get_model_config)
        config.pipeline_dtype = model.torch_dtype
        config.variable_seq_lengths = False
        config.batch_p2p_comm = False
        config.deallocate_pipeline_outputs = True
        if pair.chunks > 1:
            config.virtual_pipeline_model_parallel_size = pair.chunks
            config.microbatch_group_size_per_vp_stage = pp
        if pair.overlap:  # after TransformerConfig's bf16/fp16 assertion: see the module docstring
            for chunk in self.chunks:
                chunk.config.overlap_moe_expert_parallel_comm = True
        self.function = getattr(schedules, pair.function)
        self.interleaved = pair.chunks > 1
        self.chunks_per_rank = pair.chunks
        self.seq_length = model.seq_length
        self.micro_batch_size = micro_batch_size
        self.modules = list(self.chunks)
        self.params = [param for chunk in self.chunks for param in chunk.parameters()]
        self.meter: ActivationMeter | None = None

    def step(self, measure: bool = True) -> tuple[float | None, int | None]:
        """One training step; returns (mean microbatch loss on the last rank else None, the
        activation peak when ``measure``: timed steps run Megatron's schedule bare)."""
        iterators = [iter(self.batches) for _ in self.chunks]
        meter = ActivationMeter(enabled=measure)
        meter.exclude(self.params)
        with meter.saving(), virtual_pipeline(self.chunks_per_rank if self.interleaved else None):
            reports = self.function(
                forward_step_func=forward_step,
                data_iterator=iterators if self.interleaved else iterators[0],
                model=self.chunks if self.interleaved else self.chunks[0],
                num_microbatches=len(self.batches),
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
            )
        loss = None
        if reports:
            loss = sum(microbatch_loss(item["lm loss"]) for item in reports) / len(reports)
        return loss, meter.peak


@contextlib.contextmanager
def virtual_pipeline(size: int | None) -> Iterator[None]:
    """Megatron's parallel state with ``size`` model chunks per pipeline rank (None: without
    interleaving), as Megatron-LM sets it, for one step: combined 1F1B computes the loss on
    the pipeline's last rank only for the last chunk by it
    (``forward_step_calc_loss``'s fallback); the other jobs run without it."""
    from megatron.core import parallel_state

    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(size)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(before)
