"""torch.distributed.pipelining on the same megatron-core stages, counted like our runtime.

Each virtual stage is the same ``GPTModel`` our runtime runs (same layers, weights copied from
one reference), wrapped in a thin module whose forward takes and returns tensors, as torch's
``PipelineStage`` needs: tokens -> hidden on the first stage, hidden -> hidden in the middle (via
Megatron's ``set_input_tensor``), hidden -> logits on the last. The loss is the schedule's
``loss_fn``: Megatron's own cross entropy and the main job's ``loss_func``, divided by the
microbatch's token count, with ``scale_grads=True`` dividing by the number of microbatches:
our runtime's (Megatron's) normalisation.

Activation bytes are counted with our :class:`~megatron_pp_ext.runtime.ActivationMeter`, by
storage, parameters excluded: what autograd saves during the step (``saved_tensors_hooks``), each
stage's input and output for as long as the tensor lives (torch keeps outputs until their
backward: it does not free them after the send as Megatron and our runtime do), and the receive
buffers torch allocates once per microbatch and keeps across steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from ..megatron.model import ModelConfig, build_stage, copy_from_reference, layer_offsets, split_layers
from ..megatron.steps import loss_func
from ..runtime import ActivationMeter
from ..schedule.ir import Placement
from .job import TorchPair
from .our_job import ModuleJob


class LiveBytes:
    """One step's activation meter for torch's schedule, renewed by :meth:`start`."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.params = [param for module in modules for param in module.parameters()]
        self.meter = ActivationMeter()
        self.buffer_bytes = 0
        self.enabled = True
        self._buffer_holds: list[Any] = []

    def start(self, buffers: list[Tensor], enabled: bool = True) -> None:
        self.enabled = enabled
        self.meter = ActivationMeter()
        if not enabled:
            return
        self.meter.exclude(self.params)
        self._buffer_holds = self.meter.hold_all(buffers)
        self.buffer_bytes = self.meter.live

    def saving(self) -> AbstractContextManager[None]:
        return self.meter.saving() if self.enabled else nullcontext()

    def track(self, tensor: Tensor) -> None:
        """Count ``tensor``'s storage until the tensor is collected."""
        if self.enabled:
            hold = self.meter.hold(tensor)
            weakref.finalize(tensor, hold.release)

    @property
    def peak(self) -> int:
        return self.meter.peak


class StageModule(torch.nn.Module):
    """A megatron-core stage with a tensor-in, tensor-out forward for ``PipelineStage``."""

    def __init__(self, model: torch.nn.Module, is_first: bool, is_last: bool, live: LiveBytes) -> None:
        super().__init__()
        self.model = model
        self.is_first = is_first
        self.is_last = is_last
        self.live = live

    def forward(self, x: Tensor) -> Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
            out = self.model(x, positions, None)
        else:
            self.live.track(x)
            self.model.set_input_tensor(x)
            out = self.model(None, None, None)
        self.live.track(out)
        return out  # hidden [s, b, h]; logits [b, s, v] on the last stage


class MaskedLoss:
    """``loss_fn(logits, target)``: Megatron's cross entropy, then the main job's ``loss_func``
    normalised like Megatron's ``forward_step`` (per microbatch; torch's ``scale_grads`` then
    divides by the number of microbatches).
    ``target`` packs labels and loss mask as ``[b, 2, s]`` so torch splits both by microbatch."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, logits: Tensor, target: Tensor) -> Tensor:
        logits = logits.transpose(0, 1).contiguous()  # back to Megatron's [s, b, v]
        losses = self.model.compute_language_model_loss(target[:, 0], logits)
        result = loss_func(target[:, 1], losses)
        if len(result) == 3:  # (sum, tokens, report): divide by the tokens as our runtime does
            return result[0] / torch.clamp(result[1], min=1)
        return result[0]


def pack_inputs(batches: list[dict[str, Tensor]], device: torch.device) -> tuple[Tensor, Tensor]:
    """The whole batch as torch's ``step`` takes it: tokens and packed targets, split on dim 0."""
    tokens = torch.cat([batch["tokens"] for batch in batches]).to(device)
    target = torch.cat(
        [torch.stack([batch["labels"], batch["loss_mask"].to(torch.long)], dim=1) for batch in batches]
    ).to(device)
    return tokens, target


def recv_buffers(stages: list[Any]) -> Iterator[Tensor]:
    """The receive buffers torch's stages keep (per microbatch, activations and gradients)."""
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for infos in table.values():
                for info in infos if isinstance(infos, tuple) else (infos,):
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, Tensor):
                        yield buffer


def example_tensors(
    model: ModelConfig, micro_batch_size: int, first: bool, last: bool
) -> tuple[Tensor, Tensor]:
    """A stage's input and output shapes (on the meta device) for ``PipelineStage``'s static mode:
    tokens ``[b, s]`` into the first, hidden ``[s, b, h]`` between stages, logits ``[b, s, v]`` out."""
    b, s = micro_batch_size, model.seq_length
    dtype = model.torch_dtype
    hidden = torch.empty(s, b, model.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(b, s, dtype=torch.long, device="meta")
    logits = torch.empty(b, s, model.vocab_size, dtype=dtype, device="meta", requires_grad=True)
    return (tokens if first else hidden), (logits if last else hidden)


class TorchJob(ModuleJob):
    """One rank of a torch.distributed.pipelining schedule on our model's stages."""

    def __init__(
        self,
        pair: TorchPair,
        model: ModelConfig,
        reference: torch.nn.Module,
        batches: list[dict[str, Tensor]],
        pp: int,
        rank: int,
        micro_batch_size: int,
        device: torch.device,
        group: Any = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        cls = getattr(schedules, pair.cls, None)
        if cls is None:
            raise LookupError(f"torch {torch.__version__} has no {pair.cls}")
        num_stages = pp * pair.stages_per_rank
        placement = Placement(pp, num_stages, pair.placement)
        layers = split_layers(model.num_layers, num_stages)
        offsets = layer_offsets(layers)
        self.holds_first = placement.rank_of(0) == rank
        self.holds_last = placement.rank_of(num_stages - 1) == rank
        self.modules: list[StageModule] = []
        self.live = LiveBytes([])
        self.stages = []
        loss = None
        for stage in placement.stages_of(rank):
            gpt = build_stage(model, stage, layers)
            copy_from_reference(reference, gpt, offsets[stage])
            first, last = stage == 0, stage == num_stages - 1
            module = StageModule(gpt, first, last, self.live)
            example_in, example_out = example_tensors(model, micro_batch_size, first, last)
            if last:
                loss = MaskedLoss(gpt)
            self.modules.append(module)
            self.stages.append(
                PipelineStage(
                    module,
                    stage,
                    num_stages,
                    device,
                    input_args=(example_in,),
                    output_args=(example_out,),
                    group=group,
                )
            )
        self.live.params = [param for module in self.modules for param in module.parameters()]
        # torch runs backward only where a loss_fn is given: every rank gets one, the last stage's calls it.
        loss_fn = loss if loss is not None else MaskedLoss(self.modules[0].model)
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        self.schedule = cls(
            self.stages[0] if single else self.stages, len(batches), loss_fn=loss_fn, scale_grads=True
        )
        self.tokens, self.target = pack_inputs(batches, device)

    def step(self, measure: bool = True) -> tuple[float | None, int]:
        """One step; returns (mean microbatch loss on the loss rank else None, activation peak).
        Without ``measure`` torch runs bare (the peak is then 0): timed steps do not pay for
        the meter's hooks."""
        self.live.start(list(recv_buffers(self.stages)), enabled=measure)
        args = (self.tokens,) if self.holds_first else ()
        target = self.target if self.holds_last else None
        losses: list[Tensor] = []
        with self.live.saving():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        loss = sum(float(value.detach()) for value in losses) / len(losses) if self.holds_last else None
        return loss, self.live.peak
