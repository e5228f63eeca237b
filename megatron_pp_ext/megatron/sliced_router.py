"""megatron-core's top-k router in a sequence-sliced chunk: the auxiliary losses of the sequence.

Routing is per token, so a slice routes its tokens as the whole sequence would. The auxiliary
losses are not per token:

- the load-balancing loss is E * sum_e f_e * P_e, with f_e the fraction of the *sequence's*
  tokens sent to expert e and P_e the mean router probability over the sequence. Its gradient
  reaches each token's probabilities through f_e, a whole-sequence count that is known only once
  every slice has routed. Every sliced schedule runs all forwards of a microbatch before its first
  backward (the last slice's backward comes first; ``schedule.validate.slice_order_error`` checks
  it for the schedule as run), so the count is complete when any backward runs:
  :class:`SequenceLoadBalancingLoss` reads it then. A slice's share uses the sequence's token
  count T, so the slices' shares add up to the sequence's loss.
- the z-loss is a mean over tokens: a slice's mean is weighted by its share of the sequence's
  tokens (with ``calculate_per_token_loss`` megatron-core already scales each part by its own
  token count, which adds up over slices).

The class swap is done by ``sliced.enable_slicing``; the router's own code, its dispatcher and its
logging run unchanged. Load-balancing types whose statistics are not the sequence's
(``seq_aux_loss`` reshapes by the slice's length, ``global_aux_loss`` accumulates across
microbatches in forward order) and token dropping with a capacity factor are refused under
slices (``runtime.slicing.check_sliced_moe``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from ..attention import SliceContext


class SequenceCounts:
    """One microbatch's tokens per expert, summed over its slices as they route."""

    def __init__(self, slices: int) -> None:
        self.slices = slices
        self.routed: set[int] = set()
        self.counts: Tensor | None = None

    def add(self, slice_index: int, counts: Tensor) -> None:
        if slice_index in self.routed:
            raise RuntimeError(f"slice {slice_index} routed twice in one microbatch")
        self.routed.add(slice_index)
        self.counts = counts.detach().clone() if self.counts is None else self.counts + counts.detach()

    def complete(self) -> Tensor:
        if len(self.routed) != self.slices or self.counts is None:
            raise RuntimeError(
                f"a backward ran before every slice of its microbatch routed ({len(self.routed)} of "
                f"{self.slices}): the load-balancing loss needs the sequence's token counts"
            )
        return self.counts


class SequenceLoadBalancingLoss(torch.autograd.Function):
    """A slice's share of the switch load-balancing loss, ``factor * sum_e (sum_t p_te) * c_e``,
    whose counts ``c_e`` are the sequence's, read at backward (the forward's value uses the counts
    routed so far: it is only logged)."""

    @staticmethod
    def forward(ctx: Any, probs: Tensor, counts: SequenceCounts, factor: float) -> Tensor:
        ctx.counts, ctx.factor, ctx.shape = counts, factor, probs.shape
        so_far = counts.counts if counts.counts is not None else torch.zeros(probs.shape[-1])
        return (probs.sum(dim=0) * so_far.to(probs.dtype)).sum() * factor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        counts = ctx.counts.complete().to(grad.dtype)
        return (grad * ctx.factor * counts).expand(ctx.shape), None, None


class SlicedTopKRouter(TopKRouter):
    """megatron-core's TopKRouter whose auxiliary losses are the sequence's (module docstring)."""

    slice_context: SliceContext
    sequence_counts: dict[int, SequenceCounts]

    def _sequence_share(self) -> tuple[int, int, int] | None:
        """(slice index, tokens of the running slice, tokens of its sequence), one sequence; None
        where the whole sequence runs at once (an unsliced schedule on sliced chunks, as under
        context parallelism in ``train``): megatron-core's router is then the sequence's."""
        current = self.slice_context.current
        if current is None:
            return None
        lengths = self.slice_context.slicing(current[0])
        if lengths is None or len(lengths) == 1:
            return None
        return current[1], lengths[current[1]], sum(lengths)

    def _apply_aux_loss(
        self, probs: Tensor, scores_for_aux_loss: Tensor, routing_map: Tensor, with_padding_mask: bool = False
    ) -> Tensor:
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        share = self._sequence_share()
        if share is None:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        if with_padding_mask:
            raise ValueError("padding masks with sequence slices: the sequence's token count is not known")
        counts, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=self.tp_cp_group, topk=self.topk
        )
        slice_index, slice_tokens, sequence_tokens = share
        microbatch = self.slice_context.current[0]
        if slice_index == 0:
            self.sequence_counts[microbatch] = SequenceCounts(len(self.slice_context.slicing(microbatch)))
        sequence = self.sequence_counts[microbatch]
        sequence.add(slice_index, counts)
        total = total_tokens * sequence_tokens // slice_tokens  # T of the sequence (all TP/CP ranks)
        factor = self.config.num_moe_experts * coeff / (self.topk * total * total)
        aux_loss = SequenceLoadBalancingLoss.apply(scores_for_aux_loss, sequence, factor)
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            aux_loss,
            "load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=local_tokens * sequence_tokens // slice_tokens,  # this rank's share
        )

    def apply_z_loss(self, logits: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        coeff = self.config.moe_z_loss_coeff
        training = self.training and torch.is_grad_enabled()
        share = self._sequence_share()
        if coeff is None or self.calculate_per_token_loss or not training or share is None:
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        _, slice_tokens, sequence_tokens = share
        self.config.moe_z_loss_coeff = coeff * slice_tokens / sequence_tokens  # this slice's weight
        try:
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        finally:
            self.config.moe_z_loss_coeff = coeff


def slice_routers(chunk: torch.nn.Module, context: SliceContext) -> int:
    """Make ``chunk``'s top-k routers :class:`SlicedTopKRouter` reading ``context``; returns how many."""
    count = 0
    for module in chunk.modules():
        if isinstance(module, TopKRouter):
            if type(module) not in (TopKRouter, SlicedTopKRouter):
                raise ValueError(
                    f"sequence slices support megatron-core's TopKRouter, not {type(module).__name__}"
                )
            module.__class__ = SlicedTopKRouter
            module.slice_context = context
            module.sequence_counts = getattr(module, "sequence_counts", {})
            count += 1
    return count
