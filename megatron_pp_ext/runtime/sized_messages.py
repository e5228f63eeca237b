"""Messages whose shape changes from microbatch to microbatch (``config.variable_seq_lengths``).

Megatron's p2p sends each tensor's shape ahead of it in a message of its own. Here a message is
one buffer of fixed size instead: a header of :data:`HEADER_SLOTS` int64 (the number of
dimensions, then the shape) followed by the tensor's bytes, padded to the step's
``tensor_shape`` (the longest sequence the caller announces: Megatron's ``seq_length``). Every
receive is therefore posted, before its tensor exists and in the step's one message order, with
the size its sender will send, so NCCL's rules (rendezvous sends, in-order completion) see the
same messages as with fixed shapes, and ``--pp-emulate-nccl`` checks them the same way. The cost:
every message travels at the announced size.

A tensor larger than the announced size cannot be sent: its header still goes out (so the
receiver fails at once with the shape named, instead of waiting for a timeout: :func:`unpack`
raises :class:`TooLong`) and the sender fails with the same words (:func:`too_long_message`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

HEADER_SLOTS = 8  # int64: ndim, then up to 7 dimensions
_HEADER_BYTES = HEADER_SLOTS * 8


class TooLong(ValueError):
    """A tensor larger than the message size announced for the step."""


def wire_size(capacity: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one message for tensors of up to ``capacity``'s elements of ``dtype``."""
    itemsize = dtype.itemsize
    return _HEADER_BYTES + math.prod(capacity) * itemsize


def pack(tensor: Tensor, capacity: Sequence[int], wire: torch.device) -> Tensor:
    """``tensor`` as one message (uint8 on ``wire``); :class:`TooLong` after packing the header
    alone when it does not fit."""
    if tensor.dim() > HEADER_SLOTS - 1:
        raise ValueError(
            f"a message has at most {HEADER_SLOTS - 1} dimensions, got shape {tuple(tensor.shape)}"
        )
    buffer = torch.zeros(wire_size(capacity, tensor.dtype), dtype=torch.uint8, device=wire)
    header = torch.tensor([tensor.dim(), *tensor.shape], dtype=torch.int64)
    buffer[: header.numel() * 8].copy_(header.view(torch.uint8))
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if not fits(tensor, capacity):
        return buffer
    buffer[_HEADER_BYTES : _HEADER_BYTES + data.numel()].copy_(data)
    return buffer


def fits(tensor: Tensor, capacity: Sequence[int]) -> bool:
    return tensor.numel() <= math.prod(capacity)


def unpack(buffer: Tensor, dtype: torch.dtype, capacity: Sequence[int], what: str) -> Tensor:
    """The tensor of a message (a view of ``buffer``); :class:`TooLong` naming ``what`` when its
    sender announced a shape larger than ``capacity``."""
    header = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
    shape = tuple(int(n) for n in header[1 : 1 + int(header[0])])
    if math.prod(shape) > math.prod(capacity):
        raise TooLong(too_long_message(what, shape, capacity))
    itemsize = dtype.itemsize
    data = buffer[_HEADER_BYTES : _HEADER_BYTES + math.prod(shape) * itemsize]
    return data.view(dtype).view(shape)


def too_long_message(what: str, shape: Sequence[int], capacity: Sequence[int]) -> str:
    return (
        f"{what}: variable_seq_lengths: a tensor of shape {tuple(shape)} is larger than the step's "
        f"message shape {tuple(capacity)}: pass the longest sequence of the step as seq_length"
    )
