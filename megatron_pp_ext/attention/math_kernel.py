"""The reference attention kernel in plain torch: runs anywhere, gives the lse, any causal shape.

It is what every other backend is tested against. Scores are formed in fp32 (fp64 for fp64
inputs), grouped-query attention is a broadcast matmul over the query heads of each KV head
(no repeated K/V), and rows with no visible key give out 0 and lse -inf without NaNs.
The backward takes the ``out`` and ``lse`` to use, so a caller can pass the merged ones of a
longer key range (see ``blocks.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of scores and lse: fp64 stays fp64, everything else is done in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """True where a query may see a key, bottom-right aligned: the last query sees every key."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return cols <= rows + (k_len - q_len)


def _grouped(q: Tensor, num_kv_heads: int) -> Tensor:
    """[b, h, s, d] -> [b, g, h/g, s, d]: query head n belongs to KV head n // (h/g)."""
    b, h, s, d = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, s, d)


def _probs(q: Tensor, k: Tensor, lse: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax probabilities [b, g, r, sq, sk] and lse [b, g, r, sq], in the compute dtype."""
    ct = compute_dtype(q.dtype)
    qg = _grouped(q, k.shape[1]).to(ct)
    scores = torch.matmul(qg, k.to(ct).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = lse.to(ct).reshape(scores.shape[:-1])
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite.unsqueeze(-1)), lse


class MathKernel:
    """Pure-torch attention with explicit forward and backward."""

    name = "math"
    general_causal = True  # handles bottom-right causal for any query/key lengths

    def supports(self, q: Tensor, k: Tensor) -> bool:
        return True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """(out [b, h, sq, d] in q's dtype, lse [b, h, sq] in the compute dtype)."""
        b, h, sq, d = q.shape
        probs, lse = _probs(q, k, None, causal, scale)
        out = torch.matmul(probs, v.to(probs.dtype).unsqueeze(2))
        return out.reshape(b, h, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, h, sq)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv for the probabilities exp(s - lse); ``out`` only enters through
        D = rowsum(dout * out), as in flash-attention kernels."""
        g = k.shape[1]
        probs, _ = _probs(q, k, lse, causal, scale)
        ct = probs.dtype
        dout_g = _grouped(dout, g).to(ct)
        delta = (dout_g * _grouped(out, g).to(ct)).sum(-1, keepdim=True)
        dv = torch.matmul(probs.transpose(-1, -2), dout_g).sum(2)
        dprobs = torch.matmul(dout_g, v.to(ct).unsqueeze(2).transpose(-1, -2))
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k.to(ct).unsqueeze(2)).reshape(q.shape)
        dk = torch.matmul(dscores.transpose(-1, -2), _grouped(q, g).to(ct)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
