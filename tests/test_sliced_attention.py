"""Sliced causal attention: partial attention + lse merge, and slices run forward in order and
backward in reverse (each slice its own autograd call) equal full causal attention."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from exactness import check, step_terms, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.attention import (
    SliceContext,
    SlicedCoreAttention,
    SlicingError,
    attach_slice_context,
    available_backends,
    check_slicing,
    choose_backend,
    merge_partials,
    partial_attention,
)
from megatron_pp_ext.attention.math_kernel import MathKernel

CPU_KERNELS = ["math", "torch_flash"]
CPU_SLICED = ["math", "torch_flash", "sdpa"]
HAS_CUDA = torch.cuda.is_available()


# --- references (plain softmax, written out here on purpose) -------------------------------------
def visible(q_len: int, k_len: int, causal: bool) -> torch.Tensor:
    """Bottom-right causal visibility [q_len, k_len]."""
    rows = torch.arange(q_len).unsqueeze(1)
    cols = torch.arange(k_len).unsqueeze(0)
    return (cols <= rows + k_len - q_len) if causal else torch.ones(q_len, k_len, dtype=torch.bool)


def reference_partial(q, k, v, mask, scale):
    """(out, lse) of q [b,h,sq,d] to k, v [b,g,sk,d] under ``mask``; rows seeing nothing: 0, -inf."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    seeing = mask.any(-1, keepdim=True)  # rows that see at least one key
    scores = scores.masked_fill(~mask, -math.inf).masked_fill(~seeing, 0.0)
    out = (torch.softmax(scores, -1) * seeing) @ v
    lse = torch.where(seeing.squeeze(-1), torch.logsumexp(scores, -1), -math.inf)
    return out, lse


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def finite_loss(out, lse, w_out, w_lse):
    """A scalar using out and the finite part of lse (rows that see no key have lse -inf)."""
    finite = torch.isfinite(lse.detach())
    return (out * w_out).sum() + torch.where(finite, lse * w_lse, torch.zeros_like(lse)).sum()


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@st.composite
def qkv_shapes(draw, max_len: int = 9):
    b = draw(st.integers(1, 2))
    g = draw(st.integers(1, 3))
    h = g * draw(st.integers(1, 3))
    d = draw(st.integers(1, 8))
    return b, h, g, d, draw(st.integers(1, max_len)), draw(st.integers(1, max_len))


def random_qkv(shape, dtype, seed):
    b, h, g, d, sq, sk = shape
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=dtype).requires_grad_()
    return make(b, h, sq, d), make(b, g, sk, d), make(b, g, sk, d)


# --- partial attention and merge ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    shape=qkv_shapes(), causal=st.booleans(), backend=st.sampled_from(CPU_KERNELS), seed=st.integers(0, 99)
)
def test_partial_attention_matches_reference_in_out_lse_and_grads(shape, causal, backend, seed):
    q, k, v = random_qkv(shape, torch.float64, seed)
    scale = 0.7
    out, lse = partial_attention(q, k, v, causal, scale=scale, backend=backend)
    ref_out, ref_lse = reference_partial(q, k, v, visible(q.shape[2], k.shape[2], causal), scale)
    assert out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert rel_error(out, ref_out) < 1e-10
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert rel_error(lse[finite], ref_lse[finite]) < 1e-10
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    got = grads_of(finite_loss(out, lse, w_out, w_lse), (q, k, v))
    want = grads_of(finite_loss(ref_out, ref_lse, w_out, w_lse), (q, k, v))
    for g_got, g_want in zip(got, want):
        g_want = torch.zeros_like(g_got) if g_want is None else g_want
        assert rel_error(g_got, g_want) < 1e-10


def test_math_partial_passes_gradcheck_with_blind_rows():
    q, k, v = random_qkv((1, 4, 2, 3, 5, 3), torch.float64, 0)

    def fn(q, k, v):
        out, lse = partial_attention(q, k, v, True, backend="math")
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v))


@settings(max_examples=60, deadline=None)
@given(
    shape=qkv_shapes(max_len=6),
    older=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    extra=st.integers(0, 3),
    backend=st.sampled_from(CPU_KERNELS),
    seed=st.integers(0, 99),
)
def test_merge_of_separate_partials_equals_the_whole(shape, older, extra, backend, seed):
    """Older key chunks non-causal + the newest (holding the diagonal) causal, merged by lse,
    equal causal attention over all keys, in out, lse and every gradient."""
    b, h, g, d, sq, _ = shape
    lengths = [*older, sq + extra]
    q, k, v = random_qkv((b, h, g, d, sq, sum(lengths)), torch.float64, seed)
    parts = []
    start = 0
    for i, n in enumerate(lengths):
        kc, vc = k[:, :, start : start + n], v[:, :, start : start + n]
        parts.append(partial_attention(q, kc, vc, causal=i == len(lengths) - 1, backend=backend))
        start += n
    out, lse = merge_partials(parts)
    whole_out, whole_lse = partial_attention(q, k, v, causal=True, backend="math")
    assert rel_error(out, whole_out) < 1e-10 and rel_error(lse, whole_lse) < 1e-10
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    got = grads_of(finite_loss(out, lse, w_out, w_lse), (q, k, v))
    want = grads_of(finite_loss(whole_out, whole_lse, w_out, w_lse), (q, k, v))
    for g_got, g_want in zip(got, want):
        assert rel_error(g_got, g_want) < 1e-10


def test_merge_gives_blind_rows_zero_weight_and_no_nan():
    """A causal chunk shorter than the queries leaves rows with lse -inf; merged with a chunk
    that every row sees, those rows take only that chunk, and gradients stay finite."""
    q, k, v = random_qkv((2, 4, 2, 4, 5, 7), torch.float64, 3)
    seen_by_all = partial_attention(q, k[:, :, :4], v[:, :, :4], causal=False)
    partly_blind = partial_attention(q, k[:, :, 4:], v[:, :, 4:], causal=True)
    assert torch.isinf(partly_blind[1]).any()
    out, lse = merge_partials([seen_by_all, partly_blind])
    mask = torch.cat([torch.ones(5, 4, dtype=torch.bool), visible(5, 3, True)], dim=1)
    ref_out, ref_lse = reference_partial(q, k, v, mask, 1 / math.sqrt(4))
    assert rel_error(out, ref_out) < 1e-10 and rel_error(lse, ref_lse) < 1e-10
    (out.sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    blind = merge_partials([partly_blind, partial_attention(q, k[:, :, 4:5], v[:, :, 4:5], causal=True)])
    assert torch.isinf(blind[1][:, :, :2]).all() and (blind[0][:, :, :2] == 0).all()


def test_flex_forward_on_cpu_matches_math():
    q, k, v = (t.detach() for t in random_qkv((1, 4, 2, 8, 6, 10), torch.float32, 1))
    for causal in (False, True):
        got = partial_attention(q, k, v, causal, backend="flex")
        want = partial_attention(q, k, v, causal, backend="math")
        assert rel_error(got[0], want[0]) < 1e-5 and rel_error(got[1], want[1]) < 1e-5


def test_flex_is_skipped_where_torch_lacks_aux_request(monkeypatch):
    """torch < 2.9 (e.g. NGC 25.03) has no FlexAttention AuxRequest: auto passes flex by, and
    asking for it names the torch version needed."""
    from megatron_pp_ext.attention import attend, backends

    q, k, _ = random_qkv((1, 2, 1, 4, 3, 3), torch.float32, 0)
    monkeypatch.setattr(backends, "flex_available", lambda: False)
    monkeypatch.setattr(attend, "flex_available", lambda: False)
    assert "flex" not in available_backends(q.detach(), k.detach(), need_lse=True, need_grad=False)
    with pytest.raises(ValueError, match=r"'flex' cannot be used here: torch .* \(torch >= 2.9 has\)"):
        choose_backend("flex", q.detach(), k.detach(), need_lse=True, need_grad=False)


def test_backend_errors_name_the_reason():
    q, k, _ = random_qkv((1, 2, 1, 4, 3, 3), torch.float32, 0)
    with pytest.raises(ValueError, match="gives no lse"):
        partial_attention(q, k, k, True, backend="sdpa")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        choose_backend("fast", q, k)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="flash_attn.*cannot be used"):
            choose_backend("flash_attn", q, k)
    assert "math" in available_backends(q, k, need_lse=True)
    with pytest.raises(ValueError, match="cannot be grouped"):
        partial_attention(q, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), True)


# --- sliced attention in a tiny attention layer ---------------------------------------------------
def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [s, b, heads, d] (d even) at the given absolute positions."""
    half = x.shape[-1] // 2
    inv = 100.0 ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    freqs = (positions.to(x.device, torch.float64).unsqueeze(1) * inv).to(x.dtype)
    cos, sin = freqs.cos()[:, None, None, :], freqs.sin()[:, None, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyAttention(torch.nn.Module):
    """q/k/v projections, rotary, core attention, output projection: enough to test gradients
    through everything around the core attention."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, backend: str, dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = torch.nn.Linear(hidden, heads * head_dim, bias=False, dtype=dtype)
        self.wk = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False, dtype=dtype)
        self.wv = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False, dtype=dtype)
        self.wo = torch.nn.Linear(heads * head_dim, hidden, bias=False, dtype=dtype)
        self.core = SlicedCoreAttention(
            config=SimpleNamespace(kv_channels=head_dim, attention_dropout=0.0),
            layer_number=1,
            backend=backend,
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q = rope(self.wq(x).view(s, b, self.heads, self.head_dim), positions)
        k = rope(self.wk(x).view(s, b, self.kv_heads, self.head_dim), positions)
        v = self.wv(x).view(s, b, self.kv_heads, self.head_dim)
        return self.wo(self.core(q, k, v, None))


def reference_layer(layer: TinyAttention, x: torch.Tensor) -> torch.Tensor:
    """The same layer over the whole sequence with the reference softmax attention."""
    s, b, _ = x.shape
    positions = torch.arange(s)
    q = rope(layer.wq(x).view(s, b, layer.heads, layer.head_dim), positions)
    k = rope(layer.wk(x).view(s, b, layer.kv_heads, layer.head_dim), positions)
    v = layer.wv(x).view(s, b, layer.kv_heads, layer.head_dim)
    bhsd = lambda t: t.permute(1, 2, 0, 3)
    out, _ = reference_partial(bhsd(q), bhsd(k), bhsd(v), visible(s, s, True), 1 / math.sqrt(layer.head_dim))
    return layer.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


@st.composite
def sliced_cases(draw):
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 4))
    batch = draw(st.integers(1, 2))
    microbatches = draw(st.integers(1, 2))
    # A pipeline-like op order: each microbatch runs F0..F(k-1) then B(k-1)..B0; microbatches interleave.
    ops = {mb: [("F", j) for j in range(len(lengths))] + [("B", j) for j in reversed(range(len(lengths)))]
           for mb in range(microbatches)}  # fmt: skip
    order = []
    while any(ops.values()):
        mb = draw(st.sampled_from([m for m, left in ops.items() if left]))
        order.append((mb, *ops[mb].pop(0)))
    return lengths, heads, kv_heads, head_dim, batch, microbatches, order


def run_sliced(layer, ctx, xs, grads, order, restrict_inputs=False):
    """Run ``order`` like a pipeline: each F on a leaf slice input, each B its own backward call."""
    outs, leaves, dx = {}, {}, {}
    for mb, kind, j in order:
        start, end = ctx.slice_bounds(j, mb)
        if kind == "F":
            leaves[mb, j] = xs[mb][start:end].detach().requires_grad_()
            with ctx.running(mb, j):
                outs[mb, j] = layer(leaves[mb, j], torch.arange(start, end))
        elif restrict_inputs:  # B/W split style: ask autograd only for the input gradient
            (dx[mb, j],) = torch.autograd.grad(outs[mb, j], leaves[mb, j], grads[mb][start:end])
        else:
            torch.autograd.backward(outs[mb, j], grads[mb][start:end])
            dx[mb, j] = leaves[mb, j].grad
    return outs, dx


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=40, deadline=None)
@given(case=sliced_cases(), backend=st.sampled_from(CPU_SLICED), seed=st.integers(0, 999))
def test_slices_forward_in_order_backward_in_reverse_equal_full_attention(dtype, case, backend, seed):
    lengths, heads, kv_heads, head_dim, batch, microbatches, order = case
    torch.manual_seed(seed)
    hidden, seq = 5, sum(lengths)
    layer = TinyAttention(hidden, heads, kv_heads, head_dim, backend, dtype)
    ctx = SliceContext(lengths, seq_length=seq)
    assert attach_slice_context(layer, ctx) == 1
    xs = [torch.randn(seq, batch, hidden, dtype=dtype) for _ in range(microbatches)]
    grads = [torch.randn(seq, batch, hidden, dtype=dtype) for _ in range(microbatches)]
    outs, dx = run_sliced(layer, ctx, xs, grads, order)
    sliced_wgrads = [p.grad.clone() for p in layer.parameters()]
    assert ctx.cached_microbatches() == []

    layer.zero_grad()
    # one layer: its weight gradients sum over every token; a row contracts over keys or features
    tol = tolerance(dtype, step_terms(seq * batch * microbatches, 1, max(seq, heads * head_dim, hidden)))
    for mb in range(microbatches):
        x = xs[mb].clone().requires_grad_()
        want = reference_layer(layer, x)
        got = torch.cat([outs[mb, j] for j in range(len(lengths))])
        check(rel_error(got, want), tol, f"microbatch {mb} output")
        torch.autograd.backward(want, grads[mb])
        check(rel_error(torch.cat([dx[mb, j] for j in range(len(lengths))]), x.grad), tol, "input grad")
    for got, param in zip(sliced_wgrads, layer.parameters()):
        check(rel_error(got, param.grad), tol, "weight grad")


@settings(max_examples=15, deadline=None)
@given(case=sliced_cases(), backend=st.sampled_from(CPU_SLICED))
def test_cached_kv_gradients_arrive_when_backward_asks_only_for_the_input(case, backend):
    """Input-only backward calls (as in B/W splitting) still route cached-K/V gradients."""
    lengths, heads, kv_heads, head_dim, batch, microbatches, order = case
    torch.manual_seed(0)
    dtype, seq = torch.float64, sum(lengths)
    layer = TinyAttention(4, heads, kv_heads, head_dim, backend, dtype)
    ctx = SliceContext(lengths, seq_length=seq)
    attach_slice_context(layer, ctx)
    xs = [torch.randn(seq, batch, 4, dtype=dtype) for _ in range(microbatches)]
    grads = [torch.randn(seq, batch, 4, dtype=dtype) for _ in range(microbatches)]
    _, dx = run_sliced(layer, ctx, xs, grads, order, restrict_inputs=True)
    for mb in range(microbatches):
        x = xs[mb].clone().requires_grad_()
        torch.autograd.backward(reference_layer(layer, x), grads[mb])
        assert rel_error(torch.cat([dx[mb, j] for j in range(len(lengths))]), x.grad) < 1e-10
    assert ctx.cached_microbatches() == []


# --- cache lifetime -----------------------------------------------------------------------------
def make_layer_and_context(lengths, backend="math"):
    layer = TinyAttention(4, 4, 2, 4, backend, torch.float64)
    ctx = SliceContext(lengths, seq_length=sum(lengths))
    attach_slice_context(layer, ctx)
    return layer, ctx


def test_cache_is_freed_after_slice_zero_backward():
    layer, ctx = make_layer_and_context([3, 2, 4])
    x = torch.randn(9, 1, 4, dtype=torch.float64)
    outs = []
    for j in range(3):
        start, end = ctx.slice_bounds(j, 0)
        with ctx.running(0, j):
            outs.append(layer(x[start:end], torch.arange(start, end)))
    held = ctx.cached_bytes(0)
    assert ctx.cached_microbatches() == [0] and held > 0
    outs[2].sum().backward()
    assert 0 < ctx.cached_bytes(0)
    outs[1].sum().backward()
    assert ctx.cached_microbatches() == [0]
    outs[0].sum().backward()
    assert ctx.cached_microbatches() == [] and ctx.cached_bytes() == 0


@pytest.mark.parametrize("backend", CPU_SLICED)
def test_forward_only_pass_frees_its_cache_and_matches(backend):
    layer, ctx = make_layer_and_context([2, 5, 1], backend)
    x = torch.randn(8, 2, 4, dtype=torch.float64)
    with torch.no_grad():
        outs = []
        for j in range(3):
            start, end = ctx.slice_bounds(j, 7)
            with ctx.running(7, j):
                outs.append(layer(x[start:end], torch.arange(start, end)))
            assert ctx.cached_microbatches() == ([7] if j < 2 else [])
        assert rel_error(torch.cat(outs), reference_layer(layer, x)) < 1e-10


def test_release_drops_a_microbatch_and_a_new_pass_can_start():
    layer, ctx = make_layer_and_context([2, 2])
    x = torch.randn(4, 1, 4, dtype=torch.float64)
    with ctx.running(0, 0):
        layer(x[:2], torch.arange(2))
    ctx.release(0)
    assert ctx.cached_microbatches() == []
    with ctx.running(0, 0):
        layer(x[:2], torch.arange(2))
    assert ctx.cached_microbatches() == [0]


# --- errors and helpers ---------------------------------------------------------------------------
def test_bad_slicing_names_the_problem():
    with pytest.raises(SlicingError, match=r"slice lengths \[4, 4\] sum to 8 tokens but the sequence has 10"):
        SliceContext([4, 4], seq_length=10)
    with pytest.raises(SlicingError, match="slice 1 has length 0"):
        check_slicing([3, 0, 2])
    with pytest.raises(SlicingError, match="empty"):
        check_slicing([])
    ctx = SliceContext([4, 4])
    with pytest.raises(SlicingError, match="slice 2 is out of range: microbatch 0 has 2 slices"):
        ctx.begin(0, 2)
    with pytest.raises(SlicingError, match="no slice is running"):
        ctx.position_offset()


def test_slice_with_wrong_token_count_is_refused():
    layer, ctx = make_layer_and_context([3, 3])
    with (
        ctx.running(0, 0),
        pytest.raises(ValueError, match=r"has 2 tokens but the slicing \[3, 3\] gives it 3"),
    ):
        layer(torch.randn(2, 1, 4, dtype=torch.float64), torch.arange(2))


def test_out_of_order_forward_and_backward_are_refused():
    layer, ctx = make_layer_and_context([2, 2, 2])
    x = torch.randn(6, 1, 4, dtype=torch.float64)
    with ctx.running(0, 1), pytest.raises(SlicingError, match="slice 1 runs forward before slice 0"):
        layer(x[2:4], torch.arange(2, 4))
    outs = []
    for j in range(3):
        with ctx.running(0, j):
            outs.append(layer(x[2 * j : 2 * j + 2], torch.arange(2 * j, 2 * j + 2)))
    with pytest.raises(SlicingError, match=r"backward of slice 1 runs before that of slice\(s\) \[2\]"):
        outs[1].sum().backward()
    with ctx.running(0, 0), pytest.raises(SlicingError, match="slice 0 runs forward again"):
        layer(x[:2], torch.arange(2))


def test_position_offsets_follow_the_slicing():
    ctx = SliceContext([5, 3, 4], seq_length=12)
    assert [ctx.position_offset(j, microbatch=0) for j in range(3)] == [0, 5, 8]
    ctx.set_slicing([2, 2], microbatch=1)  # a microbatch with its own (shorter) sequence
    with ctx.running(1, 1):
        assert ctx.slice_bounds() == (2, 4) and ctx.position_offset() == 2 and ctx.is_last_slice()
    assert ctx.slice_bounds(2, microbatch=0) == (8, 12)


def test_core_attention_without_a_slice_is_plain_causal_attention():
    core = SlicedCoreAttention(
        config=SimpleNamespace(kv_channels=8, attention_dropout=0.0), attn_mask_type="causal"
    )
    q, k, v = (torch.randn(7, 2, n, 8, dtype=torch.float64) for n in (4, 2, 2))
    out = core(q, k, v, None)
    bhsd = lambda t: t.permute(1, 2, 0, 3)
    want, _ = reference_partial(bhsd(q), bhsd(k), bhsd(v), visible(7, 7, True), 1 / math.sqrt(8))
    assert out.shape == (7, 2, 32)
    assert rel_error(out, want.permute(2, 0, 1, 3).reshape(7, 2, 32)) < 1e-10
    with pytest.raises(NotImplementedError, match="attention dropout"):
        SlicedCoreAttention(config=SimpleNamespace(kv_channels=8, attention_dropout=0.1))
    with pytest.raises(NotImplementedError, match="causal only"):
        SlicedCoreAttention(attn_mask_type="padding")


# --- GPU backends against the CPU reference -------------------------------------------------------
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch_flash", "flash_attn", "flex"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_partial_attention_matches_cpu_reference(backend, dtype):
    shape = (2, 8, 2, 64, 96, 160)
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_() for t in random_qkv(shape, torch.float32, 5))
    if backend not in available_backends(q, k, need_lse=True):
        pytest.skip(f"{backend} cannot run {dtype} here")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for causal in (False, True):
        out, lse = partial_attention(q, k, v, causal, backend=backend)
        w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
        got = grads_of(finite_loss(out, lse, w_out, w_lse), (q, k, v))
        cpu = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = partial_attention(*cpu, causal, backend="math")
        want = grads_of(finite_loss(ref_out, ref_lse, w_out.cpu().double(), w_lse.cpu().double()), cpu)
        assert rel_error(out.cpu().double(), ref_out) < tol and rel_error(lse.cpu().double(), ref_lse) < tol
        for g_got, g_want in zip(got, want):
            assert rel_error(g_got.cpu().double(), g_want) < tol


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "torch_flash", "flash_attn", "flex", "sdpa", "math"])
def test_gpu_sliced_attention_matches_cpu_reference(backend):
    lengths, dtype = [64, 48, 80, 64], torch.bfloat16
    probe = torch.empty(1, 8, 1, 64, device="cuda", dtype=dtype)
    if backend != "auto" and backend not in available_backends(probe, probe[:, :2]):
        pytest.skip(f"{backend} is not available here")
    torch.manual_seed(0)
    layer = TinyAttention(32, 8, 2, 64, "math", torch.float32)
    gpu_layer = copy.deepcopy(layer).cuda().to(dtype)
    gpu_layer.core.backend = backend
    ctx = SliceContext(lengths, seq_length=sum(lengths))
    attach_slice_context(layer, ctx)
    attach_slice_context(gpu_layer, ctx)
    seq = sum(lengths)
    xs, grads = [torch.randn(seq, 2, 32)], [torch.randn(seq, 2, 32)]
    order = [(0, "F", j) for j in range(4)] + [(0, "B", j) for j in reversed(range(4))]
    cpu_out, cpu_dx = run_sliced(layer, ctx, xs, grads, order)
    gpu_out, gpu_dx = run_sliced(gpu_layer, ctx, [xs[0].cuda().to(dtype)], [grads[0].cuda().to(dtype)], order)
    for key in cpu_out:
        assert rel_error(gpu_out[key].float().cpu(), cpu_out[key]) < 3e-2
        assert rel_error(gpu_dx[key].float().cpu(), cpu_dx[key]) < 3e-2
    assert ctx.cached_microbatches() == []


# --- glue of the GPU-only kernels, checked on CPU ---------------------------------------------------
class FakeFlashAttnInterface:
    """Stands in for flash_attn.flash_attn_interface (2.7 signatures, [b, s, heads, d] layout),
    computing with the math kernel, so the wrapper's argument order and layout are checked here."""

    @staticmethod
    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    ):  # fmt: skip
        assert dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0
        assert alibi_slopes is None and return_softmax is False
        t = lambda x: x.transpose(1, 2)
        out, lse = MathKernel().forward(t(q), t(k), t(v), causal, softmax_scale)
        return t(out).contiguous(), lse.float(), None, torch.zeros(2, dtype=torch.int64)

    @staticmethod
    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
    ):  # fmt: skip
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.is_contiguous()
        t = lambda x: x.transpose(1, 2)
        grads = MathKernel().backward(t(dout), t(q), t(k), t(v), t(out), softmax_lse, causal, softmax_scale)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(t(grad))
        return torch.empty(0)


def test_flash_attn_kernel_glue_with_a_fake_package(monkeypatch):
    from megatron_pp_ext.attention import flash_attn_kernel

    monkeypatch.setattr(flash_attn_kernel, "_interface", lambda: FakeFlashAttnInterface)
    kernel = flash_attn_kernel.FlashAttnKernel()
    q, k, v = random_qkv((2, 4, 2, 8, 5, 9), torch.float64, 4)
    for causal in (False, True):
        out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), causal, 0.3)
        ref_out, ref_lse = reference_partial(q, k, v, visible(5, 9, causal), 0.3)
        assert rel_error(out, ref_out) < 1e-10 and rel_error(lse.double(), ref_lse) < 1e-6
        dout = torch.randn_like(out)
        got = kernel.backward(
            dout, q.detach(), k.detach(), v.detach(), ref_out.detach(), ref_lse.detach(), causal, 0.3
        )
        want = grads_of((ref_out * dout).sum(), (q, k, v))
        assert all(rel_error(g, w) < 1e-6 for g, w in zip(got, want))  # the lse goes through fp32


def test_flex_sliced_forward_only_on_cpu_matches():
    layer, ctx = make_layer_and_context([3, 4], "flex")
    layer.float()
    x = torch.randn(7, 2, 4)
    with torch.no_grad():
        outs = []
        for j in range(2):
            start, end = ctx.slice_bounds(j, 0)
            with ctx.running(0, j):
                outs.append(layer(x[start:end], torch.arange(start, end)))
        assert rel_error(torch.cat(outs), reference_layer(layer, x)) < 1e-5
    assert ctx.cached_microbatches() == []
