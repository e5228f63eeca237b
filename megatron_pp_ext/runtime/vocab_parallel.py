"""Vocabulary parallelism (Yeung et al., MLSys'25, arXiv 2411.05288): the input embedding and the
output layer with its cross-entropy split evenly over the p pipeline ranks.

With a large vocabulary the first stage (embedding) and the last (output layer, logits, softmax)
carry far more weights, compute and activation memory than the others. Here the (padded)
vocabulary is cut into p equal row ranges, rank r owning rows [r V/p, (r+1) V/p) of both the
embedding table and the output weight, each range further cut over tensor parallelism as
Megatron cuts it (``VocabParallelEmbedding`` / ``ColumnParallelLinear``). :class:`VocabParallel`
holds this process's shard and runs its share of the work one op of the schedule IR at a time
(``docs/vocab_parallel.md`` specifies the ops; the method names say which)::

    # output layer, per unit (microbatch or slice); ``state`` keeps what T needs
    x, labels, g = vp.s_broadcast(x_or_None, labels_or_None, share_shape, g_or_None)   # BCAST_X
    state = vp.s_forward(x, labels, g)                   # S: logits shard, online-softmax stats
    dx = vp.s_reduce(state)                              # REDUCE_S (vocab-2: dX on the loss rank)
    losses = vp.loss(state)                              # [b, s] per-token losses, on every rank
    part = vp.t_backward(state)                          # T: weight gradient (vocab-1: dX part)
    dx = vp.t_reduce(part)                               # REDUCE_T, vocab-1: dX on the loss rank
    # input embedding, per unit
    ids = vp.e_ids(tokens_or_None, (b, s))               # BCAST_IDS
    embedded = vp.e_reduce(vp.e_forward(ids))            # REDUCE_EMB (the sum, on the first rank)
    vp.e_backward(ids, vp.e_grad(demb_or_None, (b, s)))  # BCAST_DEMB, then the rows' gradient

The two variants are the paper's. ``vocab-1`` (Algorithm 1): S computes the logits shard Z_r, its
max m_r, sum of exponentials s_r and target logit; one all-gather of (m_r, s_r, t_r) gives the
global max M = max_r m_r and sum S = sum_r s_r exp(m_r - M) (online-softmax rescaling) and the
loss log S - (z_target - M); T forms the softmax gradient, the weight gradient and this shard's
part of the input gradient, which REDUCE_T sums to the last pipeline rank: two barriers before
the last stage's backward. ``vocab-2`` (Algorithm 2): S also computes the input-gradient partials
e_r W_r and W_r[target]; REDUCE_S, after the statistics, sums exp(m_r - M)/S e_r W_r - W_r[target]
to the last rank (which scales it by the per-token loss gradient g): one barrier, and T computes
only the weight gradient. Both equal Megatron's ``vocab_parallel_cross_entropy`` (float32, or
float64 for a float64 model) and its gradient; padding rows (the vocabulary rounded up to a
multiple of p x TP) take no part, so losses and gradients are those of the unpartitioned model.

Collectives never block the issuing rank with ``async_op=True`` (a :class:`Pending` comes back;
``wait()`` gives the result): vocab-2's REDUCE_S runs its statistics, rescaling and reduce on a
worker thread, as the public code runs them on a side stream. Each channel of the IR (``x``:
BCAST_X; ``out``: REDUCE_S, REDUCE_T; ``emb``: the embedding ops) has its own process groups
(:class:`VocabGroups`), and every rank must issue a channel's collectives in the same order. Under
sequence parallelism the TP gather / reduce-scatter that Megatron's own output layer and
embedding do run synchronously inside the pipeline rank (at issue or at ``wait``). Weight
gradients land where Megatron's optimizer looks (``main_grad`` under DDP, else ``.grad``), added
directly as the runtime's W ops do. Tied embeddings (``tied=True``) use one shard for both sides;
the model chunks must then be built untied (Megatron-LM: ``--untie-embeddings-and-output-weights``).
:func:`install_embedding_feed` and :func:`install_output_capture` turn a first / last stage
GPTModel into one whose word embedding comes from REDUCE_EMB and whose output is the final hidden
state (after the final norm), with its labels kept for BCAST_X.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..schedule.ir import OpKind
from .launch_order import Launcher, Slot, direct
from .weight_grad import accumulate_grad

VARIANTS = ("vocab-1", "vocab-2")
T = TypeVar("T")


# ---- partition and groups --------------------------------------------------------------------


@dataclass(frozen=True)
class VocabPartition:
    """Which rows of the padded vocabulary this process owns: pipeline rank r owns
    [r V/p, (r+1) V/p), its TP rank t the t-th of TP equal parts of that range."""

    vocab_size: int
    pp_size: int
    pp_rank: int
    tp_size: int = 1
    tp_rank: int = 0
    divisible_by: int = 1  # Megatron-LM's make_vocab_size_divisible_by, per shard

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.pp_size < 1 or self.tp_size < 1 or self.divisible_by < 1:
            raise ValueError(f"invalid vocabulary partition {self}")
        if not (0 <= self.pp_rank < self.pp_size and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"rank out of range in {self}")

    @property
    def shards(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def padded_size(self) -> int:
        """The vocabulary rounded up so that every shard has the same number of rows."""
        unit = self.shards * self.divisible_by
        return -(-self.vocab_size // unit) * unit

    @property
    def rows_per_shard(self) -> int:
        return self.padded_size // self.shards

    def shard_rows(self, pp_rank: int, tp_rank: int) -> tuple[int, int]:
        """[start, end) of the padded vocabulary held by (pp_rank, tp_rank)."""
        start = (pp_rank * self.tp_size + tp_rank) * self.rows_per_shard
        return start, start + self.rows_per_shard

    @property
    def start(self) -> int:
        return self.shard_rows(self.pp_rank, self.tp_rank)[0]

    @property
    def end(self) -> int:
        return self.start + self.rows_per_shard

    @property
    def real_rows(self) -> int:
        """Rows of this shard inside the real vocabulary (the rest is padding, maybe all of it)."""
        return max(0, min(self.end, self.vocab_size) - self.start)


@dataclass(frozen=True)
class VocabGroups:
    """The process groups of the vocabulary collectives, one set per channel of the IR, so that
    collectives of different channels (issued in different orders on different ranks) never
    meet on one group. ``x``, ``out``, ``emb``: the pipeline (the p ranks holding the stages of
    one model replica); ``stats``: every vocabulary shard of the same tokens (TP x PP, channel
    ``out``); ``tp``: the TP group of this pipeline rank (None without TP), for the SP gathers
    done in order on the main thread; ``tp_out``: a TP group private to vocab-2's REDUCE_S worker;
    ``tp_ids``: a TP group for the first stage's token ids when only TP rank 0 reads data
    (Megatron-LM's loaders)."""

    x: Any
    out: Any
    emb: Any
    stats: Any
    tp: Any = None
    tp_out: Any = None
    tp_ids: Any = None

    def named(self) -> list[tuple[str, Any]]:
        """(channel name, group) of every group this rank has, for the warm-up."""
        names = ("x", "out", "emb", "stats", "tp", "tp_out", "tp_ids")
        return [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]

    def of_op(self, kind: OpKind, variant: str, waits: bool = False) -> list[tuple[str, Any]]:
        """(channel name, group) of the collectives a vocabulary op issues on the pipeline, or
        with ``waits`` also those whose results it waits for (S for BCAST_X, T for REDUCE_S)."""
        names = {
            OpKind.BCAST_X: ("x",),
            OpKind.REDUCE_S: ("stats", "out") if variant == "vocab-2" else ("stats",),
            OpKind.REDUCE_T: ("out",),
            OpKind.BCAST_IDS: ("emb",),
            OpKind.REDUCE_EMB: ("emb",),
            OpKind.BCAST_DEMB: ("emb",),
        }
        if waits:
            names = {**names, OpKind.S: ("x",), OpKind.T: names[OpKind.REDUCE_S]}
        return [(name, getattr(self, name)) for name in names.get(kind, ())]

    @classmethod
    def create(cls, timeout_s: float | None = None) -> VocabGroups:
        """New groups for the channels, shaped like Megatron's pipeline, tensor and model-parallel
        (``tp-pp``) groups (one pipeline over the whole world without Megatron's parallel state).
        Collective: every rank of the world calls it, in the same order. ``timeout_s``: the
        deadline of every collective on them (default: the process group's, 30 minutes), so a
        hung peer ends a vocabulary op's wait as it ends a receive."""
        from megatron.core import parallel_state

        world = dist.group.WORLD
        if parallel_state.model_parallel_is_initialized():
            pp = parallel_state.get_pipeline_model_parallel_group()
            tp = parallel_state.get_tensor_model_parallel_group()
            mp = parallel_state.get_model_parallel_group()
        else:
            pp, tp, mp = world, None, world
        tp_size = 1 if tp is None else dist.get_world_size(tp)
        if dist.get_world_size(mp) != dist.get_world_size(pp) * tp_size:
            raise ValueError(
                f"Megatron's model-parallel group has {dist.get_world_size(mp)} ranks, not TP x PP = "
                f"{tp_size} x {dist.get_world_size(pp)}: vocabulary parallelism needs it to hold "
                "exactly the shards of one set of tokens"
            )
        pp_sets, mp_sets = _all_sets(pp), _all_sets(mp)
        tp_sets = _all_sets(tp) if tp_size > 1 else None
        return cls(
            x=_new_groups(pp_sets, timeout_s),
            out=_new_groups(pp_sets, timeout_s),
            emb=_new_groups(pp_sets, timeout_s),
            stats=_new_groups(mp_sets, timeout_s),
            tp=tp if tp_size > 1 else None,
            tp_out=_new_groups(tp_sets, timeout_s) if tp_sets else None,
            tp_ids=_new_groups(tp_sets, timeout_s) if tp_sets else None,
        )

    @property
    def pp_size(self) -> int:
        return dist.get_world_size(self.x)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.x)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)


def _ranks_of(group: Any) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))


def _all_sets(group: Any) -> list[list[int]]:
    """Every rank's group of this kind (all ranks must call this), in a fixed order."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, _ranks_of(group))
    return sorted({tuple(ranks) for ranks in found})  # type: ignore[misc]


def _new_groups(sets: list[list[int]], timeout_s: float | None = None) -> Any:
    """A new group for each rank set (every rank creates all of them); this rank's one."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    mine = None
    for ranks in sets:
        group = dist.new_group(list(ranks), timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _root(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their root globally)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ---- asynchronous steps -----------------------------------------------------------------------


class Pending(Generic[T]):
    """An asynchronous step: ``wait()`` finishes it and returns its result (once)."""

    def __init__(self, work: Any, finish: Callable[[], T]) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._result: T | None = None

    def wait(self) -> T:
        if not self._done:
            if isinstance(self._work, Future):
                self._work.result()
            elif self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done = True
        return self._result  # type: ignore[return-value]


def _maybe_async(work: Any, finish: Callable[[], T], async_op: bool) -> T | Pending[T]:
    pending = Pending(work, finish)
    return pending if async_op else pending.wait()


# ---- per-unit state of the output layer ------------------------------------------------------


@dataclass
class OutputState:
    """What one unit's S leaves for REDUCE_S and T. Tokens are in Megatron's [s, b] order,
    flattened (N = s x b); labels and g come as [b, s], and ``loss()`` is [b, s] like Megatron's
    ``compute_language_model_loss``."""

    batch_shape: tuple[int, int]  # (b, s)
    hidden: Tensor | None  # [N, h], the whole sequence (gathered over TP under SP)
    exp: Tensor | None  # [N, real rows]: exp(z - local max)
    in_shard: Tensor  # [N] bool: the target row is in this shard
    target_index: Tensor  # [N] the target's row inside the shard (0 when not in it)
    local_max: Tensor  # [N]
    local_sum: Tensor  # [N]
    target: Tensor  # [N] this shard's target logit (0 when not in it)
    loss_grad: Tensor | None = None  # [N] g, dLoss/dloss_token
    grad_parts: tuple[Tensor, Tensor] | None = None  # vocab-2: e_r W_r and W_r[target], [N, h]
    global_max: Tensor | None = None
    global_sum: Tensor | None = None
    target_total: Tensor | None = None  # the target logit (from its shard)
    step: str = "s_forward"  # the last step run: checks the order of the calls
    _pending: Pending[Any] | None = field(default=None, repr=False)

    def tensors(self) -> list[Tensor]:
        """What the state keeps alive (for an activation meter)."""
        kept = [self.hidden, self.exp, *(self.grad_parts or ())]
        return [t for t in kept if t is not None]

    def settle(self) -> None:
        """Finish the state's asynchronous REDUCE_S, if it is in flight."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


# ---- the shard --------------------------------------------------------------------------------


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Megatron's cross-entropy runs in float32; a float64 model keeps float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class VocabParallel(torch.nn.Module):
    """This process's shard of the input embedding and the output layer (+ cross-entropy).

    ``variant``: ``vocab-1`` or ``vocab-2`` (the paper's Algorithms 1 and 2). ``sequence_parallel``:
    the last stage's hidden state (and the gradient sent back to it) is this TP rank's 1/TP of the
    sequence, as Megatron's output layer sees it under SP. ``scatter_embeddings``: the embedding
    output is reduce-scattered over TP along the sequence ([s/TP, b, h]), as Megatron's
    ``LanguageModelEmbedding`` asks under SP without learned positions
    (``embedding.reduce_scatter_embeddings``); else it is [b, s, h]. ``tied``: one weight for
    both sides (rank r's embedding rows are its output rows). Without ``groups`` the constructor
    creates them (:meth:`VocabGroups.create`: collective over the world). ``loss_rank``: the
    pipeline rank of the last stage (default the last rank; 0 for V-shape placements), the root
    of BCAST_X and the destination of the input-gradient reduce.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        variant: str = "vocab-1",
        tied: bool = False,
        sequence_parallel: bool = False,
        scatter_embeddings: bool | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        groups: VocabGroups | None = None,
        divisible_by: int = 1,
        init_method: Callable[[Tensor], Any] | None = None,
        loss_rank: int | None = None,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        self.groups = groups if groups is not None else VocabGroups.create()
        if sequence_parallel and self.groups.tp_size == 1:
            raise ValueError("sequence_parallel needs tensor parallelism (a TP group of more than one rank)")
        self.variant = variant
        self.tied = tied
        self.sequence_parallel = sequence_parallel
        self.scatter_embeddings = sequence_parallel if scatter_embeddings is None else scatter_embeddings
        if self.scatter_embeddings and self.groups.tp_size == 1:
            raise ValueError("scatter_embeddings needs tensor parallelism")
        if variant == "vocab-2" and self.groups.tp_size > 1 and self.groups.tp_out is None:
            raise ValueError("vocab-2 under TP needs VocabGroups.tp_out (a TP group private to REDUCE_S)")
        self.hidden_size = hidden_size
        self.partition = VocabPartition(
            vocab_size,
            self.groups.pp_size,
            self.groups.pp_rank,
            self.groups.tp_size,
            self.groups.tp_rank,
            divisible_by,
        )
        # The loss rank: the pipeline rank of the last stage (rank 0 for V-shape placements).
        self.last = self.groups.pp_size - 1 if loss_rank is None else int(loss_rank)
        if not 0 <= self.last < self.groups.pp_size:
            raise ValueError(f"loss_rank {loss_rank} is not a pipeline rank (0..{self.groups.pp_size - 1})")
        device = torch.device(device) if device is not None else _default_device()
        rows = self.partition.rows_per_shard
        self.embedding_weight = torch.nn.Parameter(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
        self.output_weight = (
            self.embedding_weight
            if tied
            else torch.nn.Parameter(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
        )
        for param in {id(p): p for p in (self.embedding_weight, self.output_weight)}.values():
            # Megatron's TP attributes: a distinct shard on every model-parallel rank, so the
            # global gradient norm (summed over TP x PP) counts it once.
            param.tensor_model_parallel = True
            param.partition_dim = 0
            param.partition_stride = 1
        self._worker: ThreadPoolExecutor | None = None  # vocab-2's REDUCE_S chain, in issue order
        # where the step's collectives are launched (the runtime's PipeComm.launch: in launch
        # order under --pp-emulate-nccl, see launch_order.py); at once by default
        self.launch: Launcher = direct()
        if init_method is not None:
            self.reset_parameters(init_method)

    # ---- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(
        self, init_method: Callable[[Tensor], Any], output_init_method: Callable[[Tensor], Any] | None = None
    ) -> None:
        """Initialise like Megatron's CPU initialisation: ``init_method`` (Megatron's
        ``embedding_init_method``) on the whole [vocab_size, h] embedding master weight, then
        ``output_init_method`` (``init_method``; default the same) on the output one, this shard's
        rows kept and padding rows zero. The same RNG state on every rank gives the same masters."""
        for name, param in self._weights().items():
            master = torch.empty(self.partition.vocab_size, self.hidden_size, dtype=torch.float32)
            method = (output_init_method or init_method) if name == "output" else init_method
            method(master)
            self._load(param, master)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron-core's checkpoint protocol (``dist_checkpointing``; GPTModel's own
        ``sharded_state_dict`` calls it on its children): the shard saved as the rows it holds of
        Megatron's own tables, ``embedding.word_embeddings.weight`` and ``output_layer.weight``
        ([vocab, h]), so the checkpoint is the one a run without vocabulary parallelism writes and
        either run loads the other's. A shard holds rows [start, start + rows) of the padded
        vocabulary, an uneven split (the last shard is shorter by the padding), so each table is a
        factory whose tensor is the shard's real rows at their global offset (uneven sharding,
        checked by DCP); the optimizer builds its moments through the same factory (it matches
        the parameter by identity). Replicated over data-parallel ranks."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        part = self.partition
        rows = part.real_rows
        if rows == 0:
            raise ValueError(
                f"vocabulary shard {part.pp_rank}/{part.tp_rank} holds only padding rows "
                f"({part.vocab_size} rows over {part.shards} shards of {part.rows_per_shard}): a "
                "checkpoint cannot place it; use fewer pipeline x tensor ranks or a smaller padding multiple"
            )
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))

        def build(key: str, tensor: Tensor, replica: Any, flattened_range: Any) -> ShardedTensor:
            real = tensor[:rows]
            return ShardedTensor(
                key=key,
                data=real,
                dtype=real.dtype,
                local_shape=tuple(real.shape),
                global_shape=(part.vocab_size, *real.shape[1:]),
                global_offset=(part.start, *([0] * (real.dim() - 1))),
                axis_fragmentations=None,  # uneven: the last shard is shorter
                replica_id=replica,
            )

        def merge(loaded: Tensor) -> Tensor:
            """The shard again, padding rows zero (a weight or a moment: the loaded dtype)."""
            full = loaded.new_zeros((part.rows_per_shard, *loaded.shape[1:]))
            full[:rows].copy_(loaded)
            return full

        tables = {"embedding_weight": ("embedding.word_embeddings.weight", self.embedding_weight)}
        if not self.tied:
            tables["output_weight"] = ("output_layer.weight", self.output_weight)
        return {
            f"{prefix}{name}": ShardedTensorFactory(key, param, build, merge, replica_id)
            for name, (key, param) in tables.items()
        }

    def _weights(self) -> dict[str, torch.nn.Parameter]:
        weights = {"embedding": self.embedding_weight}
        if not self.tied:
            weights["output"] = self.output_weight
        return weights

    @torch.no_grad()
    def load_full(self, embedding: Tensor | None = None, output: Tensor | None = None) -> None:
        """Copy this shard's rows from the whole (unpartitioned) tables, [vocab_size or padded, h]."""
        if self.tied and output is not None and embedding is not None and not torch.equal(embedding, output):
            raise ValueError("tied embeddings: the embedding and output weights must be equal")
        if embedding is None and self.tied:
            embedding = output
        if embedding is not None:
            self._load(self.embedding_weight, embedding)
        if output is not None and not self.tied:
            self._load(self.output_weight, output)

    @torch.no_grad()
    def load_tp_shards(self, embedding: Tensor | None = None, output: Tensor | None = None) -> None:
        """Copy this shard's rows from Megatron's TP shards of the tables (this TP rank's
        contiguous 1/TP of the rows, ``VocabParallelEmbedding`` / ``ColumnParallelLinear``): they
        are gathered over the pipeline rank's TP group first, since the vocabulary-parallel rows of
        (pp, tp) lie in another TP rank's Megatron shard. Collective over TP: every TP rank calls
        it, between steps. Without TP it is :meth:`load_full`."""
        group = self.groups.tp
        tables = {"embedding": embedding, "output": output}
        if group is not None:
            size = dist.get_world_size(group)
            for name, shard in tables.items():
                if shard is None:
                    continue
                shard = shard.detach().contiguous()
                full = torch.empty(
                    (size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device
                )
                dist.all_gather_into_tensor(full, shard, group=group)  # TP rank order = row order
                tables[name] = full
        self.load_full(**tables)

    def _load(self, param: Tensor, full: Tensor) -> None:
        part = self.partition
        if full.shape[-1] != self.hidden_size or full.shape[0] < part.vocab_size:
            raise ValueError(
                f"a full table must be [>= {part.vocab_size}, {self.hidden_size}], got {tuple(full.shape)}"
            )
        param.zero_()
        real = part.real_rows
        if real:
            param[:real].copy_(full[part.start : part.start + real])

    @torch.no_grad()
    def gather_full(self, which: str = "output", grad: bool = False) -> Tensor:
        """The whole [vocab_size, h] table (``which``: ``embedding`` or ``output``), or its gradient
        with ``grad``, on every rank (an all-gather over the ``stats`` group: call it between
        steps, with no vocabulary collective in flight)."""
        param = self.embedding_weight if which == "embedding" else self.output_weight
        if grad:
            value = getattr(param, "main_grad", None)
            value = param.grad if value is None else value
            value = torch.zeros_like(param) if value is None else value
        else:
            value = param
        value = value.detach().contiguous()
        group = self.groups.stats
        size = dist.get_world_size(group)
        shards = torch.empty(
            (size * value.shape[0], *value.shape[1:]), dtype=value.dtype, device=value.device
        )
        dist.all_gather_into_tensor(shards, value, group=group)  # concatenated along dim 0 (gloo's layout)
        shards = shards.view(size, *value.shape)
        index = torch.tensor([self.partition.pp_rank * self.partition.tp_size + self.partition.tp_rank])
        index = index.to(value.device)
        indices = torch.empty(size, dtype=index.dtype, device=value.device)
        dist.all_gather_into_tensor(indices, index, group=group)  # whatever the group's rank order
        full = torch.empty(
            (self.partition.padded_size, self.hidden_size), dtype=value.dtype, device=value.device
        )
        rows = self.partition.rows_per_shard
        for position, shard in enumerate(indices.tolist()):
            full[shard * rows : (shard + 1) * rows] = shards[position]
        return full[: self.partition.vocab_size].clone()

    # ---- output layer ---------------------------------------------------------------------------

    def s_broadcast(
        self,
        hidden: Tensor | None,
        labels: Tensor | None,
        share_shape: Sequence[int],
        loss_grad: Tensor | None = None,
        async_op: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor] | Pending[tuple[Tensor, Tensor, Tensor]]:
        """BCAST_X: from the last pipeline rank to every rank, in one broadcast, the final hidden
        state ``hidden`` (``share_shape``: [s, b, h], this TP rank's [s/TP, b, h] under SP), the
        ``labels`` [b, s] and the per-token loss gradient g = dLoss/dloss_token [b, s] (the loss
        mask over the token count for Megatron's loss, times the loss scale). Other ranks pass
        None. Returns the whole-sequence hidden state [s, b, h] (gathered over TP under SP, at
        ``wait``), the labels and g."""
        groups = self.groups
        share = tuple(int(n) for n in share_shape)
        seq = share[0] * (groups.tp_size if self.sequence_parallel else 1)
        batch = (share[1], seq)
        dtype, device = self.output_weight.dtype, self.output_weight.device
        specs = [(batch, torch.int64), (share, dtype), (batch, _compute_dtype(dtype))]
        if groups.pp_rank == self.last:
            if hidden is None or labels is None or loss_grad is None:
                raise ValueError(
                    "the last pipeline rank must give the hidden state, labels and loss gradient"
                )
            given = (tuple(labels.shape), tuple(hidden.shape), tuple(loss_grad.shape))
            if given != (batch, share, batch):
                raise ValueError(
                    f"s_broadcast: labels, hidden, loss grad {given}; expected {(batch, share, batch)}"
                )
            parts = [labels, hidden, loss_grad]
            buffer = _pack([p.to(device=device, dtype=d) for p, (_, d) in zip(parts, specs)])
        else:
            buffer = torch.empty(_packed_bytes(specs), dtype=torch.uint8, device=device)
        root = _root(groups.x, self.last)
        work = self.launch(lambda: dist.broadcast(buffer, src=root, group=groups.x, async_op=True), "BCAST_X")

        def finish() -> tuple[Tensor, Tensor, Tensor]:
            labels_, hidden_, grad_ = _unpack(buffer, specs)
            if self.sequence_parallel:
                hidden_ = _gather_sequence(hidden_, groups.tp, self.launch)
            return hidden_, labels_, grad_

        return _maybe_async(work, finish, async_op)

    def s_forward(self, hidden: Tensor, labels: Tensor, loss_grad: Tensor | None = None) -> OutputState:
        """S (compute): this shard's logits of the whole sequence ``hidden`` [s, b, h], their max,
        sum of exponentials and the target logit where the target falls in the shard (``labels``
        [b, s]); vocab-2 also the input-gradient partials e_r W_r and W_r[target]. ``loss_grad``
        (g, [b, s]) is needed by T and by vocab-2's REDUCE_S on the last rank."""
        part = self.partition
        seq, batch = int(hidden.shape[0]), int(hidden.shape[1])
        if tuple(labels.shape) != (batch, seq):
            raise ValueError(
                f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}: expected [b, s]"
            )
        weight = self.output_weight.detach()
        cdtype = _compute_dtype(weight.dtype)
        h2 = hidden.detach().reshape(seq * batch, -1)
        target = labels.detach().transpose(0, 1).reshape(-1).to(h2.device)  # [s, b] order, as Megatron
        real = part.real_rows
        in_shard = (target >= part.start) & (target < part.start + real)
        index = torch.where(in_shard, target - part.start, torch.zeros_like(target))
        count = h2.shape[0]
        with torch.no_grad():
            if real:
                exp = torch.matmul(h2, weight[:real].t()).to(cdtype)
                local_max = exp.max(dim=-1).values
                target_logit = exp.gather(1, index.unsqueeze(1)).squeeze(1)
                target_logit = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
                exp.sub_(local_max.unsqueeze(1)).exp_()
            else:  # a shard of padding only
                exp = torch.empty((count, 0), dtype=cdtype, device=h2.device)
                local_max = torch.full((count,), -math.inf, dtype=cdtype, device=h2.device)
                target_logit = torch.zeros(count, dtype=cdtype, device=h2.device)
            state = OutputState(
                (batch, seq), h2, exp, in_shard, index, local_max, exp.sum(dim=-1), target_logit
            )
            if loss_grad is not None:
                state.loss_grad = self._token_order(loss_grad, state)
            if self.variant == "vocab-2":
                rows = weight[:real] if real else weight[:1]
                unscaled = torch.matmul(exp.to(weight.dtype), weight[:real]).to(cdtype)  # e_r W_r
                target_rows = rows[index.clamp(max=rows.shape[0] - 1)].to(cdtype)
                target_rows.mul_(in_shard.unsqueeze(1).to(cdtype))  # W_r[target], 0 elsewhere
                state.grad_parts = (unscaled, target_rows)
        return state

    def s_reduce(self, state: OutputState, async_op: bool = False) -> Tensor | None | Pending[Tensor | None]:
        """REDUCE_S. Both variants: one all-gather of every shard's (max, sum-exp, target logit),
        combined by online-softmax rescaling. vocab-2 then sums exp(m_r - M)/S e_r W_r - W_r[target]
        to the last pipeline rank and scales it by g: the result there is the output gradient of
        the last stage ([s, b, h], [s/TP, b, h] under SP); None elsewhere (and for vocab-1).
        With ``async_op`` vocab-2's chain runs on a worker thread: nothing here blocks."""
        self._expect(state, "s_forward")
        group = self.groups.stats
        stats = torch.stack([state.local_max, state.local_sum, state.target])  # [3, N]
        size = dist.get_world_size(group)
        flat = torch.empty((size * 3, stats.shape[1]), dtype=stats.dtype, device=stats.device)
        work = self.launch(
            lambda: dist.all_gather_into_tensor(flat, stats, group=group, async_op=True),
            "REDUCE_S all-gather",
        )

        def combine() -> None:
            work.wait()
            gathered = flat.view(size, 3, -1)
            maxes, sums, targets = gathered[:, 0], gathered[:, 1], gathered[:, 2]
            global_max = maxes.max(dim=0).values
            state.global_max = global_max
            state.global_sum = (sums * torch.exp(maxes - global_max)).sum(dim=0)
            state.target_total = targets.sum(dim=0)

        state.step = "s_reduce"
        if self.variant == "vocab-1":
            pending: Pending[Any] = Pending(None, combine)
        else:
            if self._worker is None:
                # a thread that issues NCCL work must be on the rank's GPU (torch's current device
                # is per thread)
                device = self.output_weight.device
                self._worker = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="vocab-reduce-s",
                    initializer=torch.cuda.set_device if device.type == "cuda" else None,
                    initargs=(device,) if device.type == "cuda" else (),
                )
            # the worker's launches take their places in this rank's order now (launch_order.py)
            slots = [self.launch.reserve(what) for what in self._worker_launches()]
            future = self._worker.submit(self._reduce_input_grad, state, combine, slots)
            pending = Pending(future, future.result)
        state._pending = pending
        return pending if async_op else pending.wait()

    def _worker_launches(self) -> list[str]:
        """What vocab-2's worker launches for one REDUCE_S, in its order."""
        groups = self.groups
        launches = ["REDUCE_S TP reduce-scatter"] if self.sequence_parallel else []
        launches.append("REDUCE_S reduce")
        if groups.pp_rank == self.last and not self.sequence_parallel and groups.tp_out is not None:
            launches.append("REDUCE_S TP all-reduce")  # Megatron's output layer all-reduces dgrad
        return launches

    def _reduce_input_grad(
        self, state: OutputState, combine: Callable[[], None], slots: list[Slot]
    ) -> Tensor | None:
        """vocab-2's REDUCE_S after the statistics (on the worker: its groups are its own; its
        launches fill ``slots``, reserved in the main thread's order)."""
        places = iter(slots)

        def launch(start: Callable[[], Any], what: str) -> Any:
            return next(places).fill(start)

        try:
            return self._input_grad(state, combine, launch)
        except BaseException as error:
            for slot in places:
                slot.cancel(error)
            raise

    def _input_grad(
        self, state: OutputState, combine: Callable[[], None], launch: Callable[..., Any]
    ) -> Tensor | None:
        combine()
        assert state.grad_parts is not None
        unscaled, target_rows = state.grad_parts
        state.grad_parts = None
        groups = self.groups
        with torch.no_grad():
            factor = torch.exp(state.local_max - state.global_max) / state.global_sum  # 0 for a padding shard
            partial = unscaled.mul_(factor.unsqueeze(1)).sub_(target_rows)
            batch, seq = state.batch_shape
            partial = partial.reshape(seq, batch, -1)
            if self.sequence_parallel:
                partial = _reduce_scatter_sequence(partial, groups.tp_out, launch)
            root = _root(groups.out, self.last)
            launch(lambda: dist.reduce(partial, dst=root, group=groups.out, async_op=True), "").wait()
            if groups.pp_rank != self.last:
                return None
            if not self.sequence_parallel and groups.tp_out is not None:
                # Megatron's output layer all-reduces dgrad
                launch(lambda: dist.all_reduce(partial, group=groups.tp_out, async_op=True), "").wait()
            if state.loss_grad is None:
                raise ValueError("vocab-2: the last pipeline rank needs the loss gradient in S (s_forward)")
            scale = state.loss_grad.reshape(seq, batch)
            if self.sequence_parallel:
                share = seq // groups.tp_size
                scale = scale[groups.tp_rank * share : (groups.tp_rank + 1) * share]
            return partial.mul_(scale.unsqueeze(-1)).to(self.output_weight.dtype)

    def loss(self, state: OutputState) -> Tensor:
        """Per-token cross-entropy [b, s] (float32, float64 for a float64 model), the same on
        every rank once REDUCE_S is done: log S - (z_target - M)."""
        self._expect(state, "s_reduce", "t_backward")
        state.settle()
        losses = torch.log(state.global_sum) - (state.target_total - state.global_max)
        batch, seq = state.batch_shape
        return losses.reshape(seq, batch).transpose(0, 1).contiguous()

    def t_backward(self, state: OutputState, loss_grad: Tensor | float | None = None) -> Tensor | None:
        """T (compute): the softmax gradient of this shard, scaled per token by g (``loss_grad``,
        [b, s] or a scalar; None: the one given to S), accumulated into the output weight's
        gradient; vocab-1 also returns this shard's part of the hidden-state gradient, [s, b, h]
        over the whole sequence (sum it with :meth:`t_reduce`). Frees the state."""
        self._expect(state, "s_reduce")
        state.settle()
        if loss_grad is None:
            if state.loss_grad is None:
                raise ValueError("t_backward needs the per-token loss gradient (not given to S)")
            scale = state.loss_grad
        elif isinstance(loss_grad, Tensor) and loss_grad.dim() > 0:
            scale = self._token_order(loss_grad, state)
        else:
            scale = torch.as_tensor(loss_grad, dtype=state.local_max.dtype, device=state.local_max.device)
        hidden, exp = state.hidden, state.exp
        assert hidden is not None and exp is not None
        real = exp.shape[1]
        weight = self.output_weight
        batch, seq = state.batch_shape
        input_grad = None
        with torch.no_grad():
            if real:
                factor = torch.exp(state.local_max - state.global_max) / state.global_sum
                grad = exp.mul_(factor.unsqueeze(1))  # the softmax shard, in place (online softmax)
                rows = torch.arange(grad.shape[0], device=grad.device)
                grad[rows, state.target_index] -= state.in_shard.to(grad.dtype)
                grad.mul_(scale.unsqueeze(1) if scale.dim() else scale)
                grad = grad.to(weight.dtype)
                if self.variant == "vocab-1":
                    input_grad = torch.matmul(grad, weight[:real].detach())
                weight_grad = torch.matmul(grad.t(), hidden)
                if real < weight.shape[0]:
                    padding = weight_grad.new_zeros(weight.shape[0] - real, weight.shape[1])
                    weight_grad = torch.cat([weight_grad, padding])
                accumulate_grad(weight, weight_grad)
            elif self.variant == "vocab-1":
                input_grad = torch.zeros_like(hidden)
        state.hidden = state.exp = None
        state.step = "t_backward"
        return None if input_grad is None else input_grad.reshape(seq, batch, -1)

    def t_reduce(self, partial: Tensor, async_op: bool = False) -> Tensor | None | Pending[Tensor | None]:
        """REDUCE_T (vocab-1): sum the partial hidden-state gradients to the last pipeline rank:
        its result is the output gradient of the last stage ([s, b, h], [s/TP, b, h] under SP);
        None elsewhere. Under SP the reduce-scatter over TP runs first (synchronously)."""
        if self.variant != "vocab-1":
            raise RuntimeError(
                "REDUCE_T is a step of vocab-1 only (vocab-2 reduces the input gradient in REDUCE_S)"
            )
        groups = self.groups
        buffer = partial.contiguous()
        if self.sequence_parallel:
            buffer = _reduce_scatter_sequence(buffer, groups.tp, self.launch)
        root = _root(groups.out, self.last)
        work = self.launch(lambda: dist.reduce(buffer, dst=root, group=groups.out, async_op=True), "REDUCE_T")

        def finish() -> Tensor | None:
            if groups.pp_rank != self.last:
                return None
            if not self.sequence_parallel and groups.tp is not None:
                # Megatron's output layer all-reduces dgrad
                self.launch.run(
                    lambda: dist.all_reduce(buffer, group=groups.tp, async_op=True), "REDUCE_T TP"
                )
            return buffer

        return _maybe_async(work, finish, async_op)

    # ---- input embedding ------------------------------------------------------------------------

    def e_ids(self, ids: Tensor | None, batch_shape: Sequence[int], async_op: bool = False) -> Any:
        """BCAST_IDS: the token ids [b, s] from the first pipeline rank (which reads the data) to
        every rank."""
        groups = self.groups
        device = self.embedding_weight.device
        if groups.pp_rank == 0:
            if ids is None:
                raise ValueError("the first pipeline rank must give the token ids")
            buffer = ids.to(device=device, dtype=torch.int64).contiguous().clone()
        else:
            buffer = torch.empty(tuple(batch_shape), dtype=torch.int64, device=device)
        root = _root(groups.emb, 0)
        work = self.launch(
            lambda: dist.broadcast(buffer, src=root, group=groups.emb, async_op=True), "BCAST_IDS"
        )
        return _maybe_async(work, lambda: buffer, async_op)

    def ids_from_tp_rank_0(self, ids: Tensor | None, batch_shape: Sequence[int]) -> Tensor:
        """The first stage's token ids [b, s] from its TP rank 0 to the other TP ranks (before
        BCAST_IDS, synchronous), for data loaders that only TP rank 0 reads, as Megatron-LM's
        (``get_batch_on_this_tp_rank`` broadcasts the batch in the forward, too late for S/T)."""
        device = self.embedding_weight.device
        if self.groups.tp_rank == 0:
            if ids is None:
                raise ValueError("tensor-parallel rank 0 of the first stage must give the token ids")
            buffer = ids.to(device=device, dtype=torch.int64).contiguous().clone()
        else:
            buffer = torch.empty(tuple(batch_shape), dtype=torch.int64, device=device)
        dist.broadcast(buffer, src=_root(self.groups.tp_ids, 0), group=self.groups.tp_ids)
        return buffer

    def e_forward(self, ids: Tensor) -> Tensor:
        """REDUCE_EMB's compute: this shard's part of the word embedding of ``ids`` [b, s], its
        rows looked up, zeros for the other tokens; [b, s, h] ([s, b, h] when scattering)."""
        part = self.partition
        in_shard = (ids >= part.start) & (ids < part.start + part.real_rows)
        local = torch.where(in_shard, ids - part.start, torch.zeros_like(ids))
        with torch.no_grad():
            out = torch.nn.functional.embedding(local, self.embedding_weight.detach())
            out.masked_fill_(~in_shard.unsqueeze(-1), 0.0)
        if self.scatter_embeddings:
            out = out.transpose(0, 1).contiguous()
        return out

    def e_reduce(self, partial: Tensor, async_op: bool = False) -> Tensor | None | Pending[Tensor | None]:
        """REDUCE_EMB: sum the parts to the first pipeline rank: there the output of Megatron's
        ``VocabParallelEmbedding`` ([b, s, h], or this TP rank's [s/TP, b, h] when scattering);
        None elsewhere."""
        groups = self.groups
        buffer = partial.contiguous()
        if self.scatter_embeddings:
            buffer = _reduce_scatter_sequence(buffer, groups.tp, self.launch)
        root = _root(groups.emb, 0)
        work = self.launch(
            lambda: dist.reduce(buffer, dst=root, group=groups.emb, async_op=True), "REDUCE_EMB"
        )

        def finish() -> Tensor | None:
            if groups.pp_rank != 0:
                return None
            if not self.scatter_embeddings and groups.tp is not None:
                self.launch.run(
                    lambda: dist.all_reduce(buffer, group=groups.tp, async_op=True), "REDUCE_EMB TP"
                )
            return buffer

        return _maybe_async(work, finish, async_op)

    def e_grad(self, grad: Tensor | None, batch_shape: Sequence[int], async_op: bool = False) -> Any:
        """BCAST_DEMB: the gradient of the word-embedding output from the first pipeline rank to
        every rank (in the layout :meth:`e_reduce` gave); returned as [b, s, h] for
        :meth:`e_backward`."""
        groups = self.groups
        batch, seq = (int(n) for n in batch_shape)
        hidden = self.hidden_size
        shape = (seq // groups.tp_size, batch, hidden) if self.scatter_embeddings else (batch, seq, hidden)
        dtype, device = self.embedding_weight.dtype, self.embedding_weight.device
        if groups.pp_rank == 0:
            if grad is None or tuple(grad.shape) != shape:
                raise ValueError(f"the first pipeline rank must give the embedding gradient {shape}")
            buffer = grad.detach().to(device=device, dtype=dtype).contiguous().clone()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        root = _root(groups.emb, 0)
        work = self.launch(
            lambda: dist.broadcast(buffer, src=root, group=groups.emb, async_op=True), "BCAST_DEMB"
        )

        def finish() -> Tensor:
            if not self.scatter_embeddings:
                return buffer
            return _gather_sequence(buffer, groups.tp, self.launch).transpose(0, 1)

        return _maybe_async(work, finish, async_op)

    def e_backward(self, ids: Tensor, grad: Tensor) -> None:
        """Accumulate this shard's rows of the embedding gradient (``grad`` [b, s, h])."""
        part = self.partition
        real = part.real_rows
        if not real:
            return
        in_shard = ((ids >= part.start) & (ids < part.start + real)).reshape(-1)
        rows = (ids.reshape(-1) - part.start)[in_shard]
        values = grad.reshape(-1, grad.shape[-1])[in_shard]
        weight = self.embedding_weight
        with torch.no_grad():
            weight_grad = torch.zeros_like(weight)
            weight_grad.index_add_(0, rows, values.to(weight.dtype))
            accumulate_grad(weight, weight_grad)

    # ---- helpers --------------------------------------------------------------------------------

    def _token_order(self, per_token: Tensor, state: OutputState) -> Tensor:
        """[b, s] -> [s*b] in Megatron's token order, in the compute dtype."""
        if tuple(per_token.shape) != state.batch_shape:
            raise ValueError(f"per-token tensor {tuple(per_token.shape)} is not [b, s] = {state.batch_shape}")
        return (
            per_token.detach().transpose(0, 1).reshape(-1).to(state.local_max.device, state.local_max.dtype)
        )

    def close(self) -> None:
        """Stop vocab-2's REDUCE_S worker thread (after the last step)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def _expect(self, state: OutputState, *steps: str) -> None:
        if state.step not in steps:
            raise RuntimeError(
                f"{self.variant}: this step needs the state after {' or '.join(steps)}, "
                f"it is after {state.step}"
            )


# ---- collectives and packing ------------------------------------------------------------------


def _gather_sequence(x: Tensor, group: Any, launch: Callable[..., Any]) -> Tensor:
    """All-gather along the sequence over TP (``launch``: a :class:`Launcher`, or a helper's)."""
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    share = x.contiguous()
    launch(
        lambda: dist.all_gather_into_tensor(out, share, group=group, async_op=True), "TP all-gather"
    ).wait()
    return out


def _reduce_scatter_sequence(x: Tensor, group: Any, launch: Callable[..., Any]) -> Tensor:
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the {size} TP ranks")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    whole = x.contiguous()
    launch(
        lambda: dist.reduce_scatter_tensor(out, whole, group=group, async_op=True), "TP reduce-scatter"
    ).wait()
    return out


_ALIGN = 8


def _segment_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    nbytes = math.prod(shape) * dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_bytes(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    return sum(_segment_bytes(shape, dtype) for shape, dtype in specs)


def _pack(parts: Sequence[Tensor]) -> Tensor:
    """Tensors of any dtypes in one byte buffer (8-byte aligned segments): one broadcast."""
    specs = [(tuple(p.shape), p.dtype) for p in parts]
    buffer = torch.zeros(_packed_bytes(specs), dtype=torch.uint8, device=parts[0].device)
    offset = 0
    for part, (shape, dtype) in zip(parts, specs):
        nbytes = math.prod(shape) * dtype.itemsize
        buffer[offset : offset + nbytes] = part.detach().contiguous().reshape(-1).view(torch.uint8)
        offset += _segment_bytes(shape, dtype)
    return buffer


def _unpack(buffer: Tensor, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[Tensor]:
    parts, offset = [], 0
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        parts.append(buffer[offset : offset + nbytes].view(dtype).reshape(tuple(shape)))
        offset += _segment_bytes(shape, dtype)
    return parts


# ---- model-chunk hooks ------------------------------------------------------------------------


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


class EmbeddingFeed(torch.nn.Module):
    """Stands in for the first stage's ``embedding.word_embeddings``: returns the word embedding
    the vocabulary-parallel ranks computed (:meth:`VocabParallel.e_reduce`), so position
    embeddings, the SP scatter and dropout of Megatron's ``LanguageModelEmbedding`` still apply.
    Give it the tensor before the stage's forward with :meth:`put` (make it a leaf that requires
    grad: its ``.grad`` is what :meth:`VocabParallel.e_grad` broadcasts)."""

    def __init__(self, scatter: bool) -> None:
        super().__init__()
        self.scatter = scatter
        self._queue: list[Tensor] = []

    def put(self, embedded: Tensor) -> None:
        self._queue.append(embedded)

    def forward(self, input_ids: Tensor) -> Tensor:
        if not self._queue:
            raise RuntimeError(
                "the vocabulary-parallel word embedding of this microbatch was not given (put)"
            )
        embedded = self._queue.pop(0)
        batch, seq = input_ids.shape
        if self.scatter:
            ok = embedded.shape[1] == batch and seq % embedded.shape[0] == 0
        else:
            ok = tuple(embedded.shape[:2]) == (batch, seq)
        if not ok:
            raise RuntimeError(
                f"word embedding {tuple(embedded.shape)} does not fit input ids {tuple(input_ids.shape)}"
            )
        return embedded


class OutputCapture(torch.nn.Module):
    """Stands in for the last stage's ``output_layer``: GPTModel's forward then returns the final
    hidden state (after the final norm; [s, b, h], this TP rank's [s/TP, b, h] under SP) instead
    of the loss, and keeps the labels it was given for S (``labels``, [b, s], one per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[Tensor] = []

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None):
        return hidden_states, None

    def keep_labels(self, labels: Tensor, logits: Tensor) -> Tensor:
        """GPTModel's ``compute_language_model_loss(labels, logits)``: keep the labels, return the
        hidden state unchanged."""
        self.labels.append(labels)
        return logits

    def take_labels(self) -> Tensor:
        if not self.labels:
            raise RuntimeError("no labels kept: the last stage's forward_step_func must pass labels")
        return self.labels.pop(0)


def _check_untied(gpt: torch.nn.Module) -> None:
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        raise ValueError(
            "vocabulary parallelism replaces the embedding and output layer of the chunks: build them "
            "untied (share_embeddings_and_output_weights=False; Megatron-LM: "
            "--untie-embeddings-and-output-weights) and pass tied=True to VocabParallel to tie the shards"
        )


def install_embedding_feed(chunk: torch.nn.Module) -> EmbeddingFeed:
    """Replace the first stage's word embedding (and drop its full table) by an
    :class:`EmbeddingFeed`. Call before wrapping the chunk in DDP."""
    gpt = _unwrap(chunk)
    _check_untied(gpt)
    embedding = getattr(gpt, "embedding", None)
    if embedding is None:
        raise ValueError("the chunk has no embedding: it is not the first stage (pre_process)")
    feed = EmbeddingFeed(bool(getattr(embedding, "reduce_scatter_embeddings", False)))
    embedding.word_embeddings = feed
    return feed


def install_output_capture(chunk: torch.nn.Module) -> OutputCapture:
    """Replace the last stage's output layer (and drop its full weight) by an
    :class:`OutputCapture`; its forward returns the final hidden state. Call before DDP."""
    gpt = _unwrap(chunk)
    _check_untied(gpt)
    if not getattr(gpt, "post_process", False):
        raise ValueError("the chunk has no output layer: it is not the last stage (post_process)")
    capture = OutputCapture()
    gpt.output_layer = capture
    gpt.compute_language_model_loss = capture.keep_labels  # instance attribute: GPTModel's own is untouched
    gpt.sharded_state_dict = functools.partial(_sharded_state_dict_without_output_layer, gpt)
    return capture


def _sharded_state_dict_without_output_layer(
    gpt: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> dict[str, Any]:
    """GPTModel's ``sharded_state_dict`` for a last stage whose output layer is an
    :class:`OutputCapture`: megatron-core's module walk (each child's own, the shards' included)
    without LanguageModule's step that marks ``output_layer.weight``, which is not there (the
    shards write the table's rows, :meth:`VocabParallel.sharded_state_dict`). Megatron-LM's
    ``save_checkpoint`` calls it."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = MegatronModule.sharded_state_dict(gpt, prefix, sharded_offsets, metadata)
    state.pop(f"{prefix}output_layer._extra_state", None)  # as GPTModel: always empty
    return state
