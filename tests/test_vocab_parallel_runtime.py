"""Vocabulary parallelism (runtime/vocab_parallel.py) on real gloo processes: the loss, the
gradient of the hidden state, the output-weight and the embedding gradients equal those of
megatron-core's unpartitioned modules (``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``
and ``VocabParallelEmbedding``, under Megatron's own TP when TP > 1) on the same inputs, for
vocab-1 and vocab-2 (the paper's Algorithms 1 and 2, as docs/vocab_parallel.md specifies the ops),
with a vocabulary that p (x TP) does not divide (and one that leaves a shard all padding), two
units whose passes interleave (S0 S1 T0 T1), every collective asynchronous, the IR's channels
issued in a different order on different ranks, tied weights and DDP-style ``main_grad``. In
float64 the reference is plain torch in float64 (Megatron's cross-entropy runs in float32). One
more case runs two real GPTModel stages with the embedding feed and output capture hooks and
compares every gradient with the whole single-process model.

Run ``pytest tests/test_vocab_parallel_runtime.py -s`` to print the errors measured.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks

from megatron_pp_ext.runtime.vocab_parallel import (
    OutputCapture,
    VocabPartition,
    _pack,
    _unpack,
    install_output_capture,
)

BATCH, SEQ, HIDDEN, MICROBATCHES = 2, 8, 16, 2
# max |error| <= TOL, or max |error| / max |reference| <= TOL for quantities above 1 (a loss of 5 in
# float32 has an ulp of 4.8e-7: 1e-6 absolute would be two ulps there)
F32_TOL = 1e-6
F64_TOL = 1e-12


# ---- without processes ------------------------------------------------------------------------


def test_partition_pads_and_covers_the_vocabulary() -> None:
    for vocab, pp, tp in [(67, 2, 1), (67, 3, 1), (70, 2, 2), (5, 4, 2), (64, 4, 1)]:
        parts = [VocabPartition(vocab, pp, r, tp, t) for r in range(pp) for t in range(tp)]
        padded = parts[0].padded_size
        assert padded % (pp * tp) == 0 and vocab <= padded < vocab + pp * tp
        assert sum(p.real_rows for p in parts) == vocab
        starts = [p.start for p in parts]
        assert starts == sorted(starts) and starts[0] == 0
        assert all(b.start == a.end for a, b in zip(parts, parts[1:]))
    # Megatron's order inside a pipeline rank: TP rank t holds the t-th part of the stage's rows.
    assert VocabPartition(70, 2, 1, 2, 1).shard_rows(1, 1) == (54, 72)


def test_pack_roundtrip_mixed_dtypes() -> None:
    parts = [
        torch.arange(6).reshape(2, 3),
        torch.randn(3, 2, 5).to(torch.bfloat16),
        torch.randn(2, 3, dtype=torch.float64),
    ]
    unpacked = _unpack(_pack(parts), [(tuple(p.shape), p.dtype) for p in parts])
    for part, back in zip(parts, unpacked):
        assert back.dtype == part.dtype and torch.equal(back, part)


def test_output_capture_refuses_tied_chunks() -> None:
    class Tied(torch.nn.Module):
        share_embeddings_and_output_weights = True
        post_process = True
        decoder = None

    with pytest.raises(ValueError, match="--untie-embeddings-and-output-weights"):
        install_output_capture(Tied())
    capture = OutputCapture()
    hidden = torch.randn(4, 2, 3)
    assert capture(hidden)[0] is hidden
    assert capture.keep_labels(torch.zeros(2, 4), hidden) is hidden and capture.take_labels().shape == (2, 4)


# ---- the shared data ----------------------------------------------------------------------------


def _data(vocab: int, dtype: torch.dtype) -> dict:
    """Full weights and every microbatch's inputs, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    data = {
        "output": (torch.randn(vocab, HIDDEN, generator=gen) * 0.5).to(dtype),
        "embedding": torch.randn(vocab, HIDDEN, generator=gen).to(dtype),
        "mbs": [],
    }
    for _ in range(MICROBATCHES):
        mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.25).to(torch.float32)
        data["mbs"].append(
            {
                "hidden": torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype),
                "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
                "tokens": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
                # dLoss/dloss_token: the loss mask (a summed loss), order-1 gradients
                "loss_grad": (mask * (1.0 + torch.rand(BATCH, SEQ, generator=gen))).to(dtype),
                "emb_grad": torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(dtype),  # [b, s, h]
            }
        )
    return data


def _err(value: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max abs reference)."""
    value, reference = value.double(), reference.double()
    diff = (value - reference).abs().max().item()
    scale = reference.abs().max().item()
    return diff, diff / scale if scale else diff


# ---- references ---------------------------------------------------------------------------------


def _megatron_reference(data: dict, vocab: int, sp: bool, scatter: bool) -> dict:
    """megatron-core's own output layer + vocab_parallel_cross_entropy and VocabParallelEmbedding,
    under Megatron's TP (which may be 1), run by every pipeline rank on the same inputs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from megatron_pp_ext.megatron.model import ModelConfig, transformer_config

    tp = parallel_state.get_tensor_model_parallel_world_size()
    t = parallel_state.get_tensor_model_parallel_rank()
    extra = {"sequence_parallel": True} if sp else {}
    config = transformer_config(
        ModelConfig(hidden_size=HIDDEN, num_attention_heads=4, num_kv_heads=2, vocab_size=vocab, extra=extra)
    )
    linear = ColumnParallelLinear(
        HIDDEN, vocab, config=config, init_method=config.init_method, bias=False, gather_output=False
    )
    embedding = VocabParallelEmbedding(
        vocab, HIDDEN, init_method=config.init_method, reduce_scatter_embeddings=scatter, config=config
    )
    rows = slice(t * vocab // tp, (t + 1) * vocab // tp)
    with torch.no_grad():
        linear.weight.copy_(data["output"][rows])
        embedding.weight.copy_(data["embedding"][rows])
    share = slice(t * SEQ // tp, (t + 1) * SEQ // tp) if sp else slice(None)
    out: dict = {"losses": [], "hidden_grad": [], "embedded": []}
    for mb in data["mbs"]:
        x = mb["hidden"][share].clone().requires_grad_(True)
        logits, _ = linear(x)
        losses = vocab_parallel_cross_entropy(logits, mb["labels"].transpose(0, 1).contiguous())
        losses = losses.transpose(0, 1)  # [b, s]
        (losses * mb["loss_grad"]).sum().backward()
        out["losses"].append(losses.detach())
        out["hidden_grad"].append(x.grad)
        embedded = embedding(mb["tokens"])
        grad = mb["emb_grad"].transpose(0, 1)[share] if scatter else mb["emb_grad"]
        (embedded * grad).sum().backward()
        out["embedded"].append(embedded.detach())
    group = parallel_state.get_tensor_model_parallel_group()
    for name, weight in (("output_grad", linear.weight), ("embedding_grad", embedding.weight)):
        full = torch.empty((tp * weight.shape[0], HIDDEN), dtype=weight.dtype)
        torch.distributed.all_gather_into_tensor(full, weight.grad.contiguous(), group=group)
        out[name] = full
    return out


def _torch_reference(data: dict) -> dict:
    """The unpartitioned model in plain torch, in the data's dtype (float64)."""
    weight = data["output"].clone().requires_grad_(True)
    table = data["embedding"].clone().requires_grad_(True)
    out: dict = {"losses": [], "hidden_grad": [], "embedded": []}
    for mb in data["mbs"]:
        x = mb["hidden"].clone().requires_grad_(True)
        logits = x @ weight.t()  # [s, b, V]
        target = mb["labels"].transpose(0, 1)
        losses = (torch.logsumexp(logits, -1) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)).t()
        (losses * mb["loss_grad"]).sum().backward()
        out["losses"].append(losses.detach())
        out["hidden_grad"].append(x.grad)
        embedded = torch.nn.functional.embedding(mb["tokens"], table)
        (embedded * mb["emb_grad"]).sum().backward()
        out["embedded"].append(embedded.detach())
    out["output_grad"], out["embedding_grad"] = weight.grad, table.grad
    return out


# ---- the vocabulary-parallel run ----------------------------------------------------------------


def _run_vocab_parallel(vp, data: dict, sp: bool) -> dict:
    """Two units whose passes interleave (S0 S1 T0 T1), every collective asynchronous, and the
    channels issued in a different order on the first pipeline rank than on the others (each
    channel in the same order everywhere, as the schedule IR asks)."""
    groups = vp.groups
    last = groups.pp_rank == groups.pp_size - 1
    first = groups.pp_rank == 0
    t, tp = groups.tp_rank, groups.tp_size
    share = slice(t * SEQ // tp, (t + 1) * SEQ // tp) if sp else slice(None)
    share_shape = (SEQ // tp if sp else SEQ, BATCH, HIDDEN)
    mbs = data["mbs"]

    def issue_ids() -> list:  # BCAST_IDS of every unit
        return [vp.e_ids(mb["tokens"] if first else None, (BATCH, SEQ), async_op=True) for mb in mbs]

    def issue_x() -> list:  # BCAST_X of every unit
        return [
            vp.s_broadcast(
                mb["hidden"][share] if last else None,
                mb["labels"] if last else None,
                share_shape,
                mb["loss_grad"] if last else None,
                async_op=True,
            )
            for mb in mbs
        ]

    if first:
        sent_ids = issue_ids()
        sent_x = issue_x()
    else:
        sent_x = issue_x()
        sent_ids = issue_ids()
    ids = [pending.wait() for pending in sent_ids]
    embedded = [vp.e_reduce(vp.e_forward(i), async_op=True) for i in ids]  # REDUCE_EMB
    states, reduces = [], []
    for index, pending in enumerate(sent_x):  # S0 REDUCE_S0 S1 REDUCE_S1
        hidden, labels, loss_grad = pending.wait()
        keep = index == 0 or vp.variant == "vocab-2"  # vocab-1's unit 1 is given g at T instead
        state = vp.s_forward(hidden, labels, loss_grad if keep else None)
        reduces.append(vp.s_reduce(state, async_op=True))
        states.append(state)
    out: dict = {"embedded": [p.wait() for p in embedded], "losses": [vp.loss(s) for s in states]}
    out["hidden_grad"] = []
    for index, (mb, state, reduce) in enumerate(zip(mbs, states, reduces)):  # T0 (REDUCE_T0) T1 ...
        if vp.variant == "vocab-1":
            partial = vp.t_backward(state, mb["loss_grad"] if index == 1 else None)
            grad = vp.t_reduce(partial, async_op=True).wait()
        else:
            assert vp.t_backward(state) is None  # vocab-2's T: the weight gradient only
            grad = reduce.wait()
        out["hidden_grad"].append(grad)
        assert (grad is not None) == last
    for mb, i in zip(mbs, ids):  # BCAST_DEMB, then the rows' gradient
        grad = None
        if first:
            grad = (
                mb["emb_grad"].transpose(0, 1)[share].contiguous()
                if vp.scatter_embeddings
                else mb["emb_grad"]
            )
        vp.e_backward(i, vp.e_grad(grad, (BATCH, SEQ), async_op=True).wait())
    out["output_grad"] = vp.gather_full("output", grad=True)
    out["embedding_grad"] = vp.gather_full("embedding", grad=True)
    return out


def _compare(got: dict, ref: dict, first: bool, last: bool, tied: bool) -> dict[str, tuple[float, float]]:
    errors = {
        "loss": max(_err(a, b) for a, b in zip(got["losses"], ref["losses"])),
    }
    if last:
        errors["hidden_grad"] = max(_err(a, b) for a, b in zip(got["hidden_grad"], ref["hidden_grad"]))
    if first:
        errors["embedding_out"] = max(_err(a, b) for a, b in zip(got["embedded"], ref["embedded"]))
    if tied:  # one shard serves both sides: its gradient is the sum of the two
        errors["tied_grad"] = _err(got["embedding_grad"], ref["output_grad"] + ref["embedding_grad"])
    else:
        errors["output_grad"] = _err(got["output_grad"], ref["output_grad"])
        errors["embedding_grad"] = _err(got["embedding_grad"], ref["embedding_grad"])
    return errors


def head_worker(rank: int, world: int, tp: int, cases: list[dict]) -> list[dict]:
    """Every case on this rank: the errors against the reference (max abs, relative)."""
    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.model import init_parallel_state
    from megatron_pp_ext.runtime.vocab_parallel import VocabGroups, VocabParallel

    cpu_shim.install()  # Megatron's SP gather buffer is allocated on torch.cuda.current_device()
    init_parallel_state(world // tp, tp)
    groups = VocabGroups.create()
    results = []
    for case in cases:
        dtype = case.get("dtype", torch.float32)
        sp, tied, vocab = case.get("sp", False), case.get("tied", False), case["vocab"]
        data = _data(vocab, dtype)
        if tied:
            data["embedding"] = data["output"]
        ref = _torch_reference(data) if dtype == torch.float64 else _megatron_reference(data, vocab, sp, sp)
        vp = VocabParallel(
            vocab,
            HIDDEN,
            variant=case["variant"],
            tied=tied,
            sequence_parallel=sp,
            dtype=dtype,
            device="cpu",
            groups=groups,
        )
        if not tied:  # Megatron's CPU initialisation: the master tables drawn whole, then cut
            torch.manual_seed(11)
            vp.reset_parameters(torch.nn.init.normal_, functools.partial(torch.nn.init.normal_, std=0.1))
            torch.manual_seed(11)
            masters = [torch.empty(vocab, HIDDEN) for _ in range(2)]
            torch.nn.init.normal_(masters[0])
            torch.nn.init.normal_(masters[1], std=0.1)
            assert torch.equal(vp.gather_full("embedding"), masters[0].to(dtype))
            assert torch.equal(vp.gather_full("output"), masters[1].to(dtype))
        vp.load_full(embedding=data["embedding"], output=data["output"])
        assert torch.equal(vp.gather_full("output"), data["output"])
        if case.get("main_grad"):  # megatron-core DDP's buffers: gradients must land there
            for param in vp.parameters():
                param.main_grad = torch.zeros_like(param)
        got = _run_vocab_parallel(vp, data, sp)
        vp.close()
        if case.get("main_grad"):
            assert all(p.grad is None for p in vp.parameters())
        first, last = groups.pp_rank == 0, groups.pp_rank == groups.pp_size - 1
        results.append({**case, "errors": _compare(got, ref, first, last, tied)})
    return results


def _check(results: list[list[dict]], label: str) -> None:
    for rank, cases in enumerate(results):
        for case in cases:
            tol = F64_TOL if case.get("dtype") == torch.float64 else F32_TOL
            name = (
                f"{label} rank {rank} {case['variant']} vocab={case['vocab']}"
                + "".join(f" {k}" for k in ("sp", "tied", "main_grad") if case.get(k))
                + (" float64" if case.get("dtype") == torch.float64 else "")
            )
            print(name, {k: f"abs {a:.2e} rel {r:.2e}" for k, (a, r) in case["errors"].items()})
            for key, (abs_err, rel_err) in case["errors"].items():
                assert abs_err <= tol or rel_err <= tol, (name, key, case["errors"])


def test_vocab_parallel_p2_matches_megatron() -> None:
    cases = [
        {"variant": "vocab-1", "vocab": 67},
        {"variant": "vocab-2", "vocab": 67, "main_grad": True},
        {"variant": "vocab-1", "vocab": 67, "tied": True},
        {"variant": "vocab-1", "vocab": 67, "dtype": torch.float64},
        {"variant": "vocab-2", "vocab": 67, "dtype": torch.float64},
    ]
    _check(check_ok(run_ranks(head_worker, 2, 1, cases, timeout=120)), "p=2")


def test_vocab_parallel_p3_matches_megatron() -> None:
    # 67 rows over 3 ranks: padded to 69, the last shard has 21 real rows and 2 of padding.
    # 4 rows over 3 ranks: padded to 6, the last shard is all padding.
    cases = [
        {"variant": "vocab-1", "vocab": 67},
        {"variant": "vocab-2", "vocab": 67, "tied": True},
        {"variant": "vocab-1", "vocab": 4},
        {"variant": "vocab-2", "vocab": 4},
    ]
    _check(check_ok(run_ranks(head_worker, 3, 1, cases, timeout=120)), "p=3")


@pytest.mark.slow
def test_vocab_parallel_tp2_pp2_matches_megatron() -> None:
    # 70 rows: Megatron's TP splits 35/35; over 2 x 2 shards padded to 72 (18 each, 16 real in the last).
    cases = [
        {"variant": "vocab-1", "vocab": 70},
        {"variant": "vocab-2", "vocab": 70, "sp": True},
        {"variant": "vocab-1", "vocab": 70, "sp": True, "tied": True},
    ]
    _check(check_ok(run_ranks(head_worker, 4, 2, cases, timeout=150)), "tp2xpp2")


# ---- two GPTModel stages with the hooks --------------------------------------------------------


def gpt_worker(rank: int, world: int, variant: str) -> dict:
    """Stage 0 (embedding feed) and stage 1 (output capture) of a 2-layer GPTModel run by hand:
    embedding, F, S, T, B, embedding backward; losses and every gradient against the whole model."""
    import torch.distributed as dist
    from runtime_case import loss_func, make_batches

    from megatron_pp_ext.megatron.model import (
        ModelConfig,
        build_reference,
        build_stage,
        copy_from_reference,
        init_parallel_state,
        reference_name,
    )
    from megatron_pp_ext.runtime.vocab_parallel import (
        VocabParallel,
        install_embedding_feed,
        install_output_capture,
    )

    init_parallel_state(world)
    model = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=67,
        seq_length=16,
    )
    torch.manual_seed(0)
    reference = build_reference(model)
    batches = make_batches(model, MICROBATCHES, seed=3)
    total = 0.0
    ref_losses = []
    for batch in batches:
        per_token = reference(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss, count, _ = loss_func(batch["loss_mask"], per_token)
        ref_losses.append(per_token.detach())
        total = total + loss / count / MICROBATCHES
    total.backward()

    stage = build_stage(model, rank, [1, 1])
    copy_from_reference(reference, stage, rank)
    feed = install_embedding_feed(stage) if rank == 0 else None
    capture = install_output_capture(stage) if rank == 1 else None
    assert all("word_embeddings" not in n and "output_layer" not in n for n, _ in stage.named_parameters())
    vp = VocabParallel(model.vocab_size, model.hidden_size, variant=variant, device="cpu")  # makes its groups
    vp.load_full(embedding=reference.embedding.word_embeddings.weight, output=reference.output_layer.weight)
    shape = (model.seq_length, 2, model.hidden_size)
    units, states, ids_kept, losses, reduced = [], [], [], [], []
    for batch in batches:  # embedding forward of every microbatch, then the stage forwards
        ids = vp.e_ids(batch["tokens"] if rank == 0 else None, batch["tokens"].shape)
        embedded = vp.e_reduce(vp.e_forward(ids))
        ids_kept.append(ids)
        if rank == 0:
            leaf = embedded.detach().requires_grad_(True)
            feed.put(leaf)
            output = stage(batch["tokens"], batch["position_ids"], None)
            dist.send(output.detach().contiguous(), 1)
            units.append((leaf, output))
        else:
            received = torch.empty(shape)
            dist.recv(received, 0)
            received.requires_grad_(True)
            stage.set_input_tensor(received)
            output = stage(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            assert output.shape == shape  # the final hidden state, not the loss
            labels = capture.take_labels()
            # dLoss/dloss_token through the user's loss_func and the schedule's normalisation
            zero = torch.zeros(labels.shape, requires_grad=True)
            loss, count, _ = loss_func(batch["loss_mask"], zero)
            (loss / count / MICROBATCHES).backward()
            units.append((received, output))
        sent = vp.s_broadcast(
            output.detach() if rank == 1 else None,
            labels if rank == 1 else None,
            shape,
            zero.grad if rank == 1 else None,
        )
        state = vp.s_forward(*sent)
        reduced.append(vp.s_reduce(state, async_op=True))  # vocab-2: dX on the loss rank
        states.append(state)
        losses.append(vp.loss(state))
    for index, state in enumerate(states):
        part = vp.t_backward(state)
        grad = vp.t_reduce(part) if variant == "vocab-1" else reduced[index].wait()
        stage_input, output = units[index]
        if rank == 1:
            output.backward(grad)
            dist.send(stage_input.grad.contiguous(), 0)
        else:
            upstream = torch.empty(shape)
            dist.recv(upstream, 1)
            output.backward(upstream)
    for index, ids in enumerate(ids_kept):
        vp.e_backward(ids, vp.e_grad(units[index][0].grad if rank == 0 else None, ids.shape))

    ref_params = dict(reference.named_parameters())
    errors = {"loss": max(_err(a, b) for a, b in zip(losses, ref_losses))}
    errors["layers"] = max(
        _err(p.grad, ref_params[reference_name(n, rank)].grad) for n, p in stage.named_parameters()
    )
    errors["output_grad"] = _err(vp.gather_full("output", grad=True), reference.output_layer.weight.grad)
    errors["embedding_grad"] = _err(
        vp.gather_full("embedding", grad=True), reference.embedding.word_embeddings.weight.grad
    )
    return errors


@pytest.mark.parametrize("variant", ["vocab-1", "vocab-2"])
def test_gpt_stages_with_hooks_match_whole_model(variant: str) -> None:
    results = check_ok(run_ranks(gpt_worker, 2, variant, timeout=120))
    for rank, errors in enumerate(results):
        print(
            f"gpt p=2 {variant} rank {rank}", {k: f"abs {a:.2e} rel {r:.2e}" for k, (a, r) in errors.items()}
        )
        for key, (abs_err, rel_err) in errors.items():
            assert abs_err <= F32_TOL or rel_err <= F32_TOL, (rank, key, errors)
