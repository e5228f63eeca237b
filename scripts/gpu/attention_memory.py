"""Peak GPU memory of one Llama-3-8B attention: Megatron's local DotProductAttention against SDPA.

Without Transformer Engine, Megatron's local layer spec (``--transformer-impl local``) attends with
megatron.core.transformer.dot_product_attention.DotProductAttention, which materialises the
[b, heads, s, s] scores (baddbmm) and their softmax (in fp32, ``attention_softmax_in_fp32``);
the plugin's local spec uses SDPAttention (megatron_pp_ext/megatron/attention.py) on PyTorch's
scaled_dot_product_attention, whose fused kernels keep O(s) per head. This measures what that
choice is worth at Llama-3-8B's attention shape: hidden 4096, 32 heads, 8 KV heads (head dim 128),
s = 8192, b = 1, bf16, causal; forward and backward, the peak of ``torch.cuda.max_memory_allocated``
above what was allocated before (q, k, v), and the time of one forward + backward.

Passes when both run and SDPA's peak stays below one bf16 [b, heads, s, s] score matrix (it is
fused) and below DotProductAttention's.
"""

from __future__ import annotations

import time

import common

SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 8192, 1, 32, 8, 128


def measure(attention, device) -> tuple[float, float]:
    """(peak bytes above the inputs, seconds) of a forward + backward of ``attention``: the peak over
    two passes from the moment the inputs exist (what the first pass allocates for good, such as
    Megatron's global memory buffer, counts), the time of the second pass."""
    import torch

    torch.manual_seed(0)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(SEQ, BATCH, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        start = time.perf_counter()
        out = attention(q, k, v, None)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        del out
        q.grad = k.grad = v.grad = None
    return torch.cuda.max_memory_allocated(device) - before, seconds


def main() -> None:
    device = common.need_cuda()
    common.init_one_process()
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_pp_ext.megatron.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, ffn_hidden_size=14336, bf16=True, params_dtype=torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
    )  # fmt: skip
    scores = BATCH * HEADS * SEQ * SEQ * 2  # one bf16 [b, heads, s, s] matrix
    print(
        f"Llama-3-8B attention: s={SEQ} b={BATCH} heads={HEADS} kv_heads={KV_HEADS} d={HEAD_DIM} "
        f"bf16 causal; one bf16 score matrix is {common.gib(scores)}"
    )
    results = {}
    for name, module in (
        ("Megatron DotProductAttention (local)", DotProductAttention(config, 1, AttnMaskType.causal, "self")),
        ("PyTorch SDPA (SDPAttention)", SDPAttention(config, 1, AttnMaskType.causal, "self")),
    ):
        try:
            results[name] = measure(module, device)
        except torch.cuda.OutOfMemoryError as error:
            results[name] = None
            print(f"{name}: out of memory ({str(error).splitlines()[0][:160]})")
            continue
        peak, seconds = results[name]
        print(f"{name}: peak {common.gib(peak)} above the inputs, forward + backward {seconds * 1e3:.1f} ms")
    local, fused = results.values()
    if fused is None:
        common.fail("SDPA ran out of memory")
    local_text = "out of memory" if local is None else common.gib(local[0])
    summary = f"peak DotProductAttention {local_text}, SDPA {common.gib(fused[0])} (s={SEQ}, bf16)"
    if fused[0] >= scores or (local is not None and fused[0] >= local[0]):
        common.fail(f"SDPA does not look fused: {summary}")
    common.passed(summary)


if __name__ == "__main__":
    main()
