"""Megatron's rotary embedding on any device: the base of the chunks' rotary embeddings.

``model.py`` gives every GPT chunk a :class:`DeviceRotaryEmbedding`; ``sliced.py`` derives the
sliced chunks' embedding from it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ..attention.cp_layout import take_local


class DeviceRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding moves its frequencies to ``torch.cuda.current_device()`` on first
    use; this one keeps them on the model's device, so the same model runs on CPU."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    @functools.lru_cache(maxsize=32)  # noqa: B019 (as Megatron's own forward: a few shapes per model)
    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        """Megatron's forward with a device-agnostic context-parallel cut (Megatron's
        ``get_pos_emb_on_this_cp_rank`` pins memory and moves to CUDA): positions
        [offset, offset + max_seq_len) cut into 2*CP pieces, this rank's two kept."""
        emb = self.get_emb(max_seq_len, offset)
        group = self.cp_group if cp_group is None else cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = take_local(emb, 0, group.size(), group.rank())
        return emb
