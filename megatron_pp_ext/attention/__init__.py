"""Sequence-sliced causal attention for Seq1F1B / SlimPipe style pipelining (standalone torch).

* ``partial_attention`` / ``merge_partials``: attention to one chunk of keys as (out, lse), and
  the lse merge of such partials; both differentiable.
* ``sliced_attention``: slice j attends to the cached K/V of slices < j and causally to itself;
  backward in reverse slice order routes the cached K/V gradients to the earlier slices.
* ``SliceContext``: per model chunk, set by the pipeline runtime (``begin(microbatch, slice)``);
  holds the slicing, position offsets for rotary embeddings, and the K/V caches.
* ``SlicedCoreAttention``: the same as a Megatron core-attention module.
"""

from .backends import AUTO_ORDER, BACKEND_NAMES, available_backends, choose_backend
from .cache import LayerCache
from .context import SliceContext
from .core_attention import SlicedCoreAttention, attach_slice_context
from .merge import merge_partials
from .partial import partial_attention
from .sliced import sliced_attention
from .slicing import SlicingError, check_slicing, slice_offsets

__all__ = [
    "AUTO_ORDER",
    "BACKEND_NAMES",
    "LayerCache",
    "SliceContext",
    "SlicedCoreAttention",
    "SlicingError",
    "attach_slice_context",
    "available_backends",
    "check_slicing",
    "choose_backend",
    "merge_partials",
    "partial_attention",
    "slice_offsets",
    "sliced_attention",
]
