"""The simulator's cost model for one plan: op durations from a device profile, with the tensor-
and context-parallel collectives inside them.

``schedule.flops.FlopCosts`` counts a whole layer's FLOPs on one device and gives TP/CP
collectives no time (docs/memory.md, "Not modelled"). The planner needs both, so this model
keeps FlopCosts for what it gets right (activation bytes under TP/SP/CP, weight-gradient shares,
offload bytes, FLOPs for MFU) and computes durations itself, per layer and slice, on one rank:

* GEMMs of the rank's TP shard over the slice's tokens on its CP rank (``Kernels.gemm``);
* flash attention over the rank's heads and its share of the causal (query, key) pairs;
* bandwidth-bound kernels (norms, SwiGLU, RoPE, residual adds, cross-entropy);
* FP8 (``fp8``, Transformer Engine's ``--fp8-format``): the linears' GEMMs (routed experts' too) at
  the profile's FP8 throughput with 1-byte operands, and each linear's input (F) and output
  gradient (B) cast to FP8 (``FP8_CAST_BYTES`` per element); attention, the router and the output
  layer stay 16-bit;
* sequence-parallel collectives: F all-gathers the inputs of the two column-parallel linears and
  reduce-scatters the outputs of the two row-parallel ones (4); B reduce-scatters the input
  gradients and all-gathers the output gradients (4); W all-gathers its operands again (2, the
  plugin keeps only this rank's share until W). A fused BW overlaps 4 of its 6 behind its GEMMs,
  as Megatron's asynchronous backward does;
* the plugin's context parallelism: the slice's K/V all-gathered over CP in F, their gradient
  reduce-scatterred in B, not overlapped;
* recomputation: ``full`` (Megatron's ``--recompute-granularity full``): B (or BW) reruns F of
  the recomputed layers first (every layer, or with ``--recompute-method block`` the first
  ``recompute_layers`` of each stage), and those layers keep only their inputs; ``selective``
  (Megatron's core-attention recompute): B reruns the attention forward, memory as without (the
  flash kernel already keeps no score matrix);
* unfused attention (Megatron before flash attention, ``--attention-backend unfused``): QK^T and
  PV as batched GEMMs over every (query, key) pair, not half of them, and the score matrix through
  memory: per score element the forward writes QK^T (2 bytes), softmax reads and writes it (4),
  dropout reads it and writes its output and mask (5), PV reads it (2): 13 bytes; the backward
  twice that. Without recomputation a layer keeps 5 bytes per score (Korthikanti et al. 2022,
  sec. 4: softmax output, dropout mask and output, "5as^2b");
* vocabulary parallelism (``--pp-vocab-parallel vocab-1|vocab-2``, ``schedule/vocab.py``): the
  output layer leaves the last stage; every rank runs S and T on its 1/p of the vocabulary (vocab-1:
  one GEMM in S, two in T; vocab-2: two and one) with its softmax traffic, and the collectives over
  the pipeline ranks take their bytes (``FlopCosts.collective_time``'s sizes) over the pipeline link;
* Transformer Engine's ``--tp-comm-overlap``: each SP all-gather or reduce-scatter runs in chunks
  beside the GEMM it feeds or drains, so only what the GEMMs cannot cover is exposed.

Mixture-of-experts layers (``ModelShape.experts``; which layers, ``moe_layer_freq``, as
``memory_model.stage_moe_layers`` counts them per stage) take, on one rank (b sequences, slice of
s tokens, n = b s / c tokens on a CP rank, n_own = n / t of them this rank's own under sequence
parallelism, k = ``routed_copies`` (top-k, or what a capacity factor keeps), E experts, f_e and
f_s the routed and shared experts' widths, EP and ETP the expert sizes of ``Layout``):

* attention as a dense layer's (its GEMMs over n tokens, flash attention, CP gathers, and its two
  SP collectives per F and per B, one per W);
* the router: an (n_own x h) @ (h x E) GEMM on the rank's own tokens, weights replicated;
* the shared expert (f_s > 0) as a dense MLP of width f_s under TP, with its two SP collectives;
* the routed experts, megatron-core's grouped GEMM (``--moe-grouped-gemm``) over the rank's E/EP
  local experts, each cut over ETP ranks. Under balanced routing each token's k copies go to
  experts uniformly, so each expert receives k/E of the copies of every token that the EP x ETP
  ranks holding one replica of all E experts route: an EP group's all-to-all brings a local
  expert k/E of the n_own tokens of each of the EP ranks, and the expert-TP all-gather (ETP > 1)
  those of the ETP ranks, so per local expert and rank m_e = n_own x k x EP x ETP / E tokens
  (the GEMMs (m_e x h) @ (h x f_e/ETP) and back). Per rank that is n_own x k x ETP copies at
  1/ETP of an expert's width: k experts' FLOPs per own token, as ``FlopCosts`` counts them
  (``PlanCosts.flops`` is FlopCosts'). Each expert's GEMM is a roofline at the profile's
  grouped-GEMM share of the peak (``Kernels.grouped_gemm``; the dense GEMM's where the profile has
  none), so a small m_e is bound by reading the expert's weights; one launch per grouped GEMM. Not
  modelled: the further loss below ~2,000 tokens per expert (tile and wave quantisation). An
  ``imbalance`` F >= 1 (``expert_load``, capped by a capacity factor) gives the busiest rank F x
  the balanced m_e, F x the routed copies' traffic and activations and F x each all-to-all;
* the expert-TP all-gather of the dispatched copies and its reduce-scatter (ETP > 1, megatron-
  core's alltoall dispatcher: ``gather_from_sequence_parallel_region`` over the expert-TP group),
  a buffer of n_own x k x ETP copies of h, in F and again (their gradients) in B;
* the expert all-to-alls (``expert_comm_time``): F dispatches and combines, B (or BW) runs their
  two backward all-to-alls. Each is split into the part that stays on the rank's node and the part
  that crosses nodes (``alltoall_parts``). The EP group is EP ranks strided by ETP (``Layout``),
  so with G = ``gpus_per_node`` a node holds c = G / ETP of them (all EP if ETP x EP <= G; 1 if
  ETP >= G) and the group spans N = EP / c nodes, each with E c / EP of the experts. Under balanced
  routing a token's k routed copies go to experts uniformly, so per rank (n_own tokens, h x 2
  bytes a copy):

  - ``dispatcher="alltoall"`` (megatron-core's alltoall dispatcher, one NCCL all-to-all over the
    EP group, one copy per routed expert, no deduplication): (c-1)/EP of the copies go to the
    other EP ranks of the node over NVLink, (EP-c)/EP to the other nodes over InfiniBand:
    in-node n_own k h 2 (c-1)/EP, cross-node n_own k h 2 (EP-c)/EP (together the (EP-1)/EP of
    ``FlopCosts.expert_alltoall_bytes``);
  - ``dispatcher="flex"`` (DeepEP / HybridEP, megatron-core's flex dispatcher): a token crosses
    InfiniBand once per other node that holds one of its experts, to the rank of the same local
    index there, which forwards the copies over NVLink. Under uniform random top-k over the E
    experts a node holding E_n of them receives the token with probability 1 - C(E - E_n, k) /
    C(E, k), so the expected number of distinct other nodes is D = (N-1) (1 - C(E - E/N, k) /
    C(E, k)) (evenly spread; the whole group would be N times that bracket, the own node is
    excluded): cross-node n_own D h 2 (scaled by ``routed_copies`` / k under a capacity factor).
    In-node: the copies to the own node's other ranks, k (c-1)/EP, plus those the receiving
    rank of another node forwards to its c-1 neighbours, k (N-1)(c-1)/EP (by symmetry what the
    rank forwards for others): n_own k h 2 (c-1)/c. Not modelled: DeepEP's per-rank
    deduplication of two experts on one GPU (the NVLink part counts every copy).

  An EP group inside one node (N = 1) sends (EP-1)/EP of the copies over NVLink under either
  dispatcher, as before the split. The two parts run concurrently on separate links (NVLink and
  the InfiniBand NICs), so an all-to-all takes max(in-node bytes / NVLink bandwidth, cross-node
  bytes / InfiniBand bandwidth) plus one collective latency. They are in the op's duration, so an
  overlapped F&B pair (``schedule/pairing.py``) hides them behind its partner's compute. Full
  recomputation reruns a recomputed MoE layer's F, all-to-alls included, inside its B;
* bandwidth-bound kernels: a dense layer's norms and residual traffic, the attention and shared
  expert's activations, and per routed copy on the rank its f_e/ETP-wide activations and the
  permute and unpermute (reading and writing h each), four more launches in F (softmax, top-k,
  permute, unpermute), eight in B.

Node-limited routing (megatron-core's ``moe_router_num_groups`` / ``moe_router_group_topk``, a
token's experts from its best M groups): with one group per node of the EP group (DeepSeek-V3's
8 groups on 8 nodes, M = 4) D = M (N-1)/N; other group counts are routed as uniform top-k.

Not modelled for MoE: FP8 dispatch, the router's auxiliary losses,
the dispatcher's token-count exchange, EP groups spread unevenly over nodes (ETP x EP neither a
multiple nor a divisor of ``gpus_per_node``: the parts are averaged over the group's ranks).

Pipeline messages take the link between neighbouring pipeline ranks; activation copies the GPU's
PCIe link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.flops import FlopCosts, head_activation_parts, layer_activation_parts
from ..schedule.ir import Op, OpKind, Schedule
from ..schedule.memory_model import TokenBytes, padded_vocab, stage_moe_layers
from ..schedule.models import ModelShape
from ..schedule.partition import DEFAULT_UNIT, causal_pairs, slice_lengths
from .devices import DeviceProfile
from .kernels import Kernels
from .layout import Layout

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "unfused")
UNFUSED_FORWARD_BYTES = 13  # per score element, see the module docstring
UNFUSED_BACKWARD_BYTES = 26
UNFUSED_KEPT_BYTES = 5
FORWARD_KERNELS = 10  # bandwidth-bound launches per layer besides GEMMs and attention
BACKWARD_KERNELS = 20
MOE_FORWARD_KERNELS = 4  # router softmax, top-k, permute, unpermute (besides a dense layer's)
MOE_BACKWARD_KERNELS = 8
DISPATCHERS = ("alltoall", "flex")  # megatron-core's --moe-token-dispatcher-type, module docstring
FP8_CAST_BYTES = 4  # per element cast to FP8: read 2 bytes, write row- and column-wise copies


def expert_load(shape: ModelShape, imbalance: float) -> float:
    """The busiest expert rank's routed copies over the balanced share: ``imbalance``, capped by
    a capacity factor (each expert computes at most c x its share; padded to capacity every
    expert computes exactly that, as ``routed_copies`` already counts)."""
    if not shape.experts or shape.capacity_factor is None:
        return imbalance if shape.experts else 1.0
    if shape.pad_to_capacity:
        return 1.0
    c = shape.capacity_factor
    return min(imbalance, c) / min(c, 1.0)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds one layer takes on one rank for one slice, by op kind (recomputation not included:
    ``recompute`` is the F a recomputed layer reruns inside its B or BW)."""

    forward: float
    backward: float
    weight: float
    fused: float
    recompute: float = 0.0


class PlanCosts:
    """CostModel (``schedule.costs.CostModel``) of ``schedule`` run by ``layout`` on ``profile``."""

    def __init__(
        self,
        shape: ModelShape,
        schedule: Schedule,
        seq_length: int,
        layout: Layout,
        profile: DeviceProfile,
        micro_batch_size: int = 1,
        recompute: str = "none",
        layers_per_stage: list[int] | None = None,
        recompute_layers: int | None = None,
        tp_comm_overlap: bool = False,
        attention: str = "flash",
        vocab: str = "none",
        dispatcher: str = "alltoall",
        fp8: bool = False,
        imbalance: float = 1.0,
    ) -> None:
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        if imbalance < 1:
            raise ValueError(f"imbalance must be at least 1 (balanced routing), got {imbalance}")
        if fp8 and profile.fp8_peak_flops <= 0:
            raise ValueError(f"{profile.name} has no FP8 tensor cores")
        self.dispatcher = dispatcher
        self.fp8 = fp8
        self.expert_load = expert_load(shape, imbalance)
        parallel = layout.parallel
        unit = math.lcm(DEFAULT_UNIT, parallel.sequence_multiple)
        lengths = slice_lengths(
            schedule.meta.get("partition", "uniform"), shape, seq_length, schedule.slices, unit
        )
        self.base = FlopCosts(
            shape=shape,
            seq_length=seq_length,
            num_stages=schedule.num_stages,
            micro_batch_size=micro_batch_size,
            slice_lengths=lengths,
            layers_per_stage=layers_per_stage,
            parallel=parallel,
            host_bandwidth=profile.pcie_bandwidth,
            vocab_parallel=vocab,
            pipeline_ranks=layout.pp,
        )
        self.vocab = vocab
        self.shape, self.layout, self.profile = shape, layout, profile
        self.kernels = Kernels(profile)
        self.recompute = recompute
        self.recompute_layers = recompute_layers  # None: every layer (full); N: the first N per stage
        self.tp_comm_overlap = tp_comm_overlap
        self.attention = attention
        self.micro_batch_size = micro_batch_size
        self.lengths = lengths
        self.ends = [sum(lengths[: j + 1]) for j in range(len(lengths))]
        self.layers = self.base.layers_per_stage
        self.moe_layers = stage_moe_layers(shape, self.layers)  # MoE layers of each virtual stage
        self.num_stages = schedule.num_stages
        self.microbatch_activation = self.base.microbatch_activation
        self.ranks_per_host = 1
        self._layer = [self._layer_times(j) for j in range(len(lengths))]
        self._alltoall = [self._alltoall_seconds(j) for j in range(len(lengths))]
        self._moe = [self._moe_layer_times(j) for j in range(len(lengths))] if shape.experts else []
        self._head = [self._head_times(j) for j in range(len(lengths))]
        self._vocab = [self._vocab_times(j) for j in range(len(lengths))]
        self._activation: dict[tuple[int, int], float] = {}
        self._share: dict[tuple[int, int], float] = {}
        self._offload: dict[tuple[int, int], float] = {}
        self._duration: dict[tuple[OpKind, int, int], float] = {}
        self._message = [self._message_seconds(j) for j in range(len(lengths))]

    # ---- per-layer and output-layer times ----------------------------------------------------

    def _local_tokens(self, j: int) -> float:
        """Tokens of slice j one CP rank processes (whole over TP: SP gathers them for GEMMs)."""
        return self.micro_batch_size * self.lengths[j] / self.layout.cp

    def _tp_collective(self, j: int) -> float:
        s, layout = self.shape, self.layout
        size = self._local_tokens(j) * s.hidden * s.bytes_per_element
        return self.kernels.collective(size, layout.tp, layout.tp_intra)

    def _linear(self, m: float, n: float, k: float) -> float:
        """A linear layer's GEMM: BF16, or FP8 under ``fp8`` (Transformer Engine's linears)."""
        if self.fp8:
            return self.kernels.gemm_fp8(m, n, k)
        return self.kernels.gemm(m, n, k, self.shape.bytes_per_element)

    def _fp8_casts(self, forward_inputs: float, backward_inputs: float) -> tuple[float, float]:
        """(forward, backward) seconds of the casts to FP8 of the linears' inputs (F) and output
        gradients (B), ``forward_inputs`` and ``backward_inputs`` elements: each read in 16 bits
        and written in FP8 twice (row- and column-wise, the second for the weight gradient)."""
        if not self.fp8:
            return 0.0, 0.0
        k = self.kernels
        return k.memory(FP8_CAST_BYTES * forward_inputs), k.memory(FP8_CAST_BYTES * backward_inputs)

    def _layer_times(self, j: int) -> LayerTimes:
        s, t, k = self.shape, self.layout.tp, self.kernels
        n, e = self._local_tokens(j), s.bytes_per_element
        up = s.ffn_matrices - 1
        gemm = (
            self._linear(n, (s.q_width + 2 * s.kv_width) / t, s.hidden)
            + self._linear(n, s.hidden, s.q_width / t)
            + self._linear(n, up * s.ffn / t, s.hidden)
            + self._linear(n, s.hidden, s.ffn / t)
        )
        cast_f, cast_b = self._fp8_casts(
            n * (2 * s.hidden + (s.q_width + s.ffn) / t),
            n * (2 * s.hidden + (s.q_width + 2 * s.kv_width + up * s.ffn) / t),
        )
        attention_f, attention_b = self._attention_times(j)
        sp_split = t if self.layout.parallel.sp else 1
        activation_elements = (3 if s.gated else 2) * s.ffn + 2 * (s.q_width + s.kv_width)
        elementwise = k.memory(e * n * (10 * s.hidden / sp_split + activation_elements / t))
        overhead = self.profile.kernel_overhead
        tp = self._tp_collective(j)
        cp = self._cp_collective(j)
        if not self.layout.parallel.sp:
            weight_tp = 0.0  # without SP every rank keeps the whole layer input for W
        else:
            weight_tp = 2 * tp
        if self.tp_comm_overlap:  # chunked beside the GEMMs: only what they cannot cover shows
            forward_tp, backward_tp, fused_tp = (max(0.0, 4 * tp - gemm),) * 2 + (
                max(0.0, 4 * tp - 2 * gemm),
            )
        else:
            forward_tp, backward_tp, fused_tp = 4 * tp, 4 * tp, 2 * tp + max(0.0, 4 * tp - 2 * gemm)
        forward = gemm + attention_f + elementwise + cast_f + forward_tp + cp + FORWARD_KERNELS * overhead
        backward_common = attention_b + 2 * elementwise + cast_b + cp + BACKWARD_KERNELS * overhead
        backward = gemm + backward_common + backward_tp
        weight = gemm + weight_tp
        fused = 2 * gemm + backward_common + fused_tp
        recompute = {"none": 0.0, "selective": attention_f, "full": forward}[self.recompute]
        return LayerTimes(forward, backward, weight, fused, recompute)

    def _attention_times(self, j: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's core attention of slice j on one rank."""
        s, t, k = self.shape, self.layout.tp, self.kernels
        pairs = causal_pairs(self.lengths[j], self.ends[j]) * self.micro_batch_size / self.layout.cp
        attention_flops = s.attention_flops_per_pair() * pairs / t
        keys = self.ends[j] - self.lengths[j] / 2
        if self.attention == "unfused":
            scores = self._scores(j)
            every_pair = (4 * s.head_dim + 3) * scores  # attention_flops_per_pair() per head
            attention_f = every_pair / k.gemm_flops + k.memory(UNFUSED_FORWARD_BYTES * scores)
            attention_b = 2 * every_pair / k.gemm_flops + k.memory(UNFUSED_BACKWARD_BYTES * scores)
        else:
            attention_f = k.attention(attention_flops, keys)
            attention_b = k.attention(2 * attention_flops, keys, backward=True)
        return attention_f, attention_b

    def _cp_collective(self, j: int) -> float:
        """The plugin's CP all-gather of slice j's K/V (F), or its gradient's reduce-scatter (B)."""
        if self.layout.cp == 1:
            return 0.0
        s = self.shape
        gathered = self.micro_batch_size * self.lengths[j] * 2 * s.kv_width / self.layout.tp
        return self.kernels.collective(gathered * s.bytes_per_element, self.layout.cp, self.layout.cp_intra)

    # ---- mixture of experts (module docstring) -------------------------------------------------

    def _own_tokens(self, j: int) -> float:
        """n_own: tokens of slice j this rank routes (its sequence shard under SP, / CP)."""
        return self.micro_batch_size * self.lengths[j] / self.layout.parallel.sequence_split

    def tokens_per_expert(self, j: int = 0) -> float:
        """m_e: tokens each of this rank's local experts computes for slice j, n_own x k x EP x
        ETP / E under balanced routing (module docstring), x ``expert_load`` on the busiest rank."""
        s, layout = self.shape, self.layout
        if not s.experts:
            return 0.0
        balanced = self._own_tokens(j) * s.routed_copies * layout.ep * layout.expert_tp / s.experts
        return balanced * self.expert_load

    def _grouped_gemm(self, groups: int, m: float, n: float, k: float) -> float:
        """``groups`` GEMMs (m x k) @ (k x n) in one grouped kernel (``Kernels.grouped_gemm``)."""
        return self.kernels.grouped_gemm(groups, m, n, k, self.fp8)

    def ep_node_ranks(self) -> list[int]:
        """EP ranks of one EP group on each node it spans (the group of rank 0: ETP x EP
        consecutive ranks, strided by ETP, ``gpus_per_node`` consecutive ranks a node)."""
        layout = self.layout
        counts: dict[int, int] = {}
        for i in range(layout.ep):
            node = i * layout.expert_tp // layout.gpus_per_node
            counts[node] = counts.get(node, 0) + 1
        return list(counts.values())

    def cross_nodes_per_token(self) -> float:
        """D: expected distinct other nodes a token's top-k reaches under uniform random routing,
        averaged over the EP group's ranks (1 - C(E - E_n, k) / C(E, k) per node of E_n experts).
        Under node-limited routing with one router group per node (DeepSeek-V3: 8 groups on 8
        nodes, the best 4 taken) a token reaches its M chosen groups, each holding one of its
        copies: M (N-1)/N other nodes when the M are any of the N alike."""
        s, ep = self.shape, self.layout.ep
        counts = self.ep_node_ranks()
        nodes = len(counts)
        if s.router_groups and s.router_groups == nodes and len(set(counts)) == 1:
            return s.router_group_topk * (nodes - 1) / nodes
        total = math.comb(s.experts, s.topk)
        reached = [1 - math.comb(s.experts - s.experts * c // ep, s.topk) / total for c in counts]
        return sum(c / ep * (sum(reached) - hit) for c, hit in zip(counts, reached, strict=True))

    def alltoall_parts(self, j: int = 0) -> tuple[float, float]:
        """(in-node, cross-node) bytes one rank sends in one expert all-to-all of slice j, under
        ``dispatcher`` (module docstring); (0, 0) for EP 1 or a dense model."""
        s, ep = self.shape, self.layout.ep
        if not s.experts or ep <= 1:
            return 0.0, 0.0
        token = self._own_tokens(j) * s.hidden * s.bytes_per_element  # one copy of each own token
        k, counts = s.routed_copies, self.ep_node_ranks()
        # in-node share of a rank's copies (c-1)/EP, averaged over the ranks (c/EP of them per node)
        inside = sum(c / ep * (c - 1) / ep for c in counts)
        if self.dispatcher == "alltoall":
            return token * k * inside, token * k * (1 - 1 / ep - inside)
        forwarded = sum(c / ep * (sum(counts) - c - (len(counts) - 1)) / ep for c in counts)
        return token * k * (inside + forwarded), token * k / s.topk * self.cross_nodes_per_token()

    def alltoall_bytes(self, j: int = 0) -> float:
        """Bytes one rank sends in one expert all-to-all of slice j, both parts: under the alltoall
        dispatcher n_own x k x h x bytes x (EP-1)/EP (``FlopCosts.expert_alltoall_bytes``, the
        same formula); 0 for EP 1 or dense."""
        return sum(self.alltoall_parts(j))

    def _alltoall_seconds(self, j: int) -> float:
        """One expert all-to-all of slice j: its in-node bytes over NVLink and its cross-node
        bytes over InfiniBand, concurrently, plus one collective latency."""
        inside, across = self.alltoall_parts(j)
        if inside + across <= 0:
            return 0.0
        k = self.kernels
        links = max(inside / k.link(True), across / k.link(False))
        return links * self.expert_load + self.profile.collective_latency  # the busiest receiver

    def alltoall_seconds(self, j: int = 0) -> float:
        return self._alltoall[j]

    def _moe_layer_times(self, j: int) -> LayerTimes:
        """One MoE layer of slice j on one rank (module docstring), all-to-alls included."""
        s, layout, k = self.shape, self.layout, self.kernels
        t, etp, e = layout.tp, layout.expert_tp, s.bytes_per_element
        n, own = self._local_tokens(j), self._own_tokens(j)
        # routed copies this rank dispatches (and gets back), x the busiest rank's load
        copies = own * s.routed_copies * self.expert_load
        fs, fe, up = s.shared_expert_ffn, s.moe_ffn, s.ffn_matrices - 1
        dense_gemm = (
            self._linear(n, (s.q_width + 2 * s.kv_width) / t, s.hidden)
            + self._linear(n, s.hidden, s.q_width / t)
            + k.gemm(own, s.experts, s.hidden, e)  # router (16-bit under FP8 too)
            + (self._linear(n, up * fs / t, s.hidden) + self._linear(n, s.hidden, fs / t) if fs else 0.0)
        )
        local, m = s.experts // layout.ep, self.tokens_per_expert(j)
        expert_gemm = self._grouped_gemm(local, m, up * fe / etp, s.hidden) + self._grouped_gemm(
            local, m, s.hidden, fe / etp
        )
        gemm = dense_gemm + expert_gemm
        received = local * m  # routed copies this rank's experts compute
        cast_f, cast_b = self._fp8_casts(
            n * (s.hidden + s.q_width / t) + (n * (s.hidden + fs / t) if fs else 0.0)
            + received * (s.hidden + fe / etp),
            n * (s.hidden + (s.q_width + 2 * s.kv_width) / t)
            + (n * (s.hidden + up * fs / t) if fs else 0.0)
            + received * (s.hidden + up * fe / etp),
        )  # fmt: skip
        attention_f, attention_b = self._attention_times(j)
        sp_split = t if layout.parallel.sp else 1
        activations = (3 if s.gated else 2) * (n * fs / t + copies * fe)
        activations += 2 * n * (s.q_width + s.kv_width) / t
        elementwise = k.memory(e * (n * 10 * s.hidden / sp_split + activations + 4 * copies * etp * s.hidden))
        tp = self._tp_collective(j)
        forward_count, weight_count = (4, 2) if fs else (2, 1)  # SP collectives: attention (+ shared)
        weight_tp = weight_count * tp if layout.parallel.sp else 0.0
        if self.tp_comm_overlap:
            forward_tp = backward_tp = max(0.0, forward_count * tp - dense_gemm)
            fused_tp = max(0.0, forward_count * tp - 2 * dense_gemm)
        else:
            forward_tp = backward_tp = forward_count * tp
            fused_tp = weight_count * tp + max(0.0, forward_count * tp - 2 * dense_gemm)
        expert_tp = k.collective(copies * etp * s.hidden * e, etp, layout.etp_intra)
        exchange = 2 * expert_tp + 2 * self._alltoall[j]  # F: gather, scatter, dispatch, combine
        cp = self._cp_collective(j)
        overhead = self.profile.kernel_overhead
        forward = (
            gemm
            + attention_f
            + elementwise
            + cast_f
            + forward_tp
            + cp
            + exchange
            + (FORWARD_KERNELS + MOE_FORWARD_KERNELS) * overhead
        )
        backward_common = (
            attention_b
            + 2 * elementwise
            + cast_b
            + cp
            + exchange
            + (BACKWARD_KERNELS + MOE_BACKWARD_KERNELS) * overhead
        )
        backward = gemm + backward_common + backward_tp
        weight = gemm + weight_tp
        fused = 2 * gemm + backward_common + fused_tp
        recompute = {"none": 0.0, "selective": attention_f, "full": forward}[self.recompute]
        return LayerTimes(forward, backward, weight, fused, recompute)

    def expert_comm_time(self, op: Op) -> float:
        """Seconds of ``op``'s expert all-to-alls (``schedule/pairs.py`` reads this name): two per
        MoE layer of its stage in an F (dispatch, combine) and in a B or BW (their gradients),
        and, under full recomputation, two more per recomputed MoE layer in B or BW; 0 for W and
        the rest, and for EP 1 or a dense model. Part of ``duration``."""
        if op.kind not in (OpKind.F, OpKind.B, OpKind.BW):
            return 0.0
        layers = self.moe_layers[op.stage]
        if op.kind is not OpKind.F and self.recompute == "full":
            layers += self.recomputed_moe_layers(op.stage)
        return 2 * layers * self._alltoall[op.slice]

    def moe_layer_seconds(self, j: int = 0) -> LayerTimes:
        """One MoE layer's times (a dense model: raises IndexError)."""
        return self._moe[j]

    def _scores(self, j: int) -> float:
        """Score elements of slice j on one rank under unfused attention: its heads x its queries
        x every key up to the slice's end."""
        heads = self.shape.heads / self.layout.tp
        return self.micro_batch_size * heads * self.lengths[j] / self.layout.cp * self.ends[j]

    def _head_times(self, j: int) -> LayerTimes:
        """Final norm, output layer and cross-entropy of slice j on the last stage."""
        s, t, k = self.shape, self.layout.tp, self.kernels
        n, e = self._local_tokens(j), s.bytes_per_element
        vocab = padded_vocab(s.vocab, t) / t
        gemm = k.gemm(n, vocab, s.hidden, e)
        loss = k.memory(3 * 4 * n * vocab)  # fp32 logits written, read and their gradient written
        tp = self._tp_collective(j)
        forward = gemm + loss + tp
        return LayerTimes(forward, gemm + loss + tp, gemm, 2 * gemm + loss + tp)

    def _vocab_times(self, j: int) -> tuple[float, float]:
        """(S, T) seconds of slice j on one rank under vocabulary parallelism: GEMMs over this
        rank's 1/(p t) of the vocabulary, the fp32 logits written and read in S (max and sum-exp),
        their gradient written and read in T."""
        if self.vocab == "none":
            return 0.0, 0.0
        s, t, k = self.shape, self.layout.tp, self.kernels
        n, e = self._local_tokens(j), s.bytes_per_element
        shard = padded_vocab(s.vocab, t * self.layout.pp) / (t * self.layout.pp)
        gemm = k.gemm(n, shard, s.hidden, e)
        traffic = k.memory(2 * 4 * n * shard)
        s_gemms, t_gemms = (2, 1) if self.vocab == "vocab-2" else (1, 2)
        tp = self._tp_collective(j)
        return s_gemms * gemm + traffic + tp, t_gemms * gemm + traffic

    def vocab_seconds(self, j: int = 0) -> tuple[float, float]:
        return self._vocab[j]

    # ---- CostModel ----------------------------------------------------------------------------

    def duration(self, op: Op) -> float:
        key = (op.kind, op.stage, op.slice)
        seconds = self._duration.get(key)
        if seconds is None:
            seconds = self._duration[key] = self._duration_of(op)
        return seconds

    def _duration_of(self, op: Op) -> float:
        if op.kind in (OpKind.S, OpKind.T):
            return self._vocab[op.slice][0 if op.kind is OpKind.S else 1]
        if not op.is_compute:
            return 0.0
        field = {OpKind.F: "forward", OpKind.B: "backward", OpKind.W: "weight", OpKind.BW: "fused"}[op.kind]
        times = self._layer[op.slice]
        moe = self.moe_layers[op.stage]
        if moe:
            moe_times = self._moe[op.slice]
            dense = self.layers[op.stage] - moe
            total = dense * getattr(times, field) + moe * getattr(moe_times, field)
        else:
            total = self.layers[op.stage] * getattr(times, field)
        if op.kind in (OpKind.B, OpKind.BW):
            recomputed_moe = self.recomputed_moe_layers(op.stage)
            if recomputed_moe:
                recomputed_dense = self.recomputed_layers(op.stage) - recomputed_moe
                total += recomputed_dense * times.recompute + recomputed_moe * self._moe[op.slice].recompute
            else:
                total += self.recomputed_layers(op.stage) * times.recompute
        if op.stage == self.num_stages - 1 and self.vocab == "none":
            total += getattr(self._head[op.slice], field)
        return total

    def _tokens(self, op: Op) -> float:
        return self.micro_batch_size * self.lengths[op.slice]

    def _cp_cache_bytes(self, op: Op) -> float:
        """Sliced attention under CP caches the gathered K/V: (c-1)/c more than the local share."""
        c = self.layout.cp
        if c == 1:
            return 0.0
        s = self.shape
        per_token = 2 * s.kv_width / self.layout.tp * s.bytes_per_element * (c - 1) / c
        return self.layers[op.stage] * self._tokens(op) * per_token

    def activation(self, op: Op) -> float:
        key = (op.stage, op.slice)
        if key not in self._activation:
            self._activation[key] = self._activation_of(op)
        return self._activation[key]

    def recomputed_layers(self, stage: int) -> int:
        """Layers of ``stage`` that full recomputation reruns (Megatron's uniform method: all of
        them; block: the first ``recompute_layers``); selective reruns attention in every layer."""
        layers = self.layers[stage]
        if self.recompute == "none":
            return 0
        if self.recompute == "selective" or self.recompute_layers is None:
            return layers
        return min(layers, self.recompute_layers)

    def recomputed_moe_layers(self, stage: int) -> int:
        """The MoE layers among :meth:`recomputed_layers` (block: the stage's first ones, in model
        order)."""
        if not self.moe_layers[stage] or self.recompute == "none":
            return 0
        if self.recompute == "selective" or self.recompute_layers is None:
            return self.moe_layers[stage]
        start = sum(self.layers[:stage])
        return sum(self.shape.moe_layers()[start : start + self.recomputed_layers(stage)])

    def _routed_imbalance_bytes(self, op: Op) -> float:
        """What the busiest rank keeps beyond balanced routing: (``expert_load`` - 1) x the routed
        copies' activations of the stage's MoE layers (``FlopCosts`` counts them balanced)."""
        if self.expert_load == 1.0 or not self.moe_layers[op.stage]:
            return 0.0
        parts = layer_activation_parts(self.shape, moe=True)
        routed = TokenBytes(0.0, 0.0, parts.routed_outside, parts.routed_inside)
        per_token = self.layout.parallel.activation(routed)
        return (self.expert_load - 1) * self.moe_layers[op.stage] * per_token * self._tokens(op)

    def _activation_of(self, op: Op) -> float:
        full = self.base.activation(op) + self._cp_cache_bytes(op)
        if self.recompute == "none" and self.attention == "unfused":
            full += self.layers[op.stage] * UNFUSED_KEPT_BYTES * self._scores(op.slice)
        if self.recompute != "full":
            return full + self._routed_imbalance_bytes(op)
        layers = self.layers[op.stage]
        recomputed = self.recomputed_layers(op.stage)
        parallel = self.layout.parallel
        inputs = recomputed * self.shape.hidden * self.shape.bytes_per_element / parallel.sequence_split
        if recomputed == layers:  # nothing but the layer inputs (and the head) is kept
            head = (
                parallel.activation(head_activation_parts(self.shape))
                if op.stage == self.num_stages - 1
                else 0
            )
            return (inputs + head) * self._tokens(op)
        kept = (layers - recomputed) / layers
        body = self.base.activation(op)
        if op.stage == self.num_stages - 1:
            head = parallel.activation(head_activation_parts(self.shape)) * self._tokens(op)
            body -= head
        else:
            head = 0.0
        extra = self._routed_imbalance_bytes(op) * kept
        return body * kept + head + inputs * self._tokens(op) + self._cp_cache_bytes(op) * kept + extra

    def weight_share(self, op: Op) -> float:
        key = (op.stage, op.slice)
        if key not in self._share:
            self._share[key] = self.base.weight_share(op)
        return self._share[key]

    def _message_seconds(self, j: int) -> float:
        s = self.shape
        tokens = self.micro_batch_size * self.lengths[j]
        size = tokens * s.hidden * s.bytes_per_element / self.layout.parallel.sequence_split
        return self.kernels.p2p(size, self.layout.pp_intra)

    def comm_latency(self, op: Op) -> float:
        return self._message[op.slice]

    def vocab_activation(self, op: Op) -> float:
        return self.base.vocab_activation(op)

    def collective_time(self, op: Op) -> float:
        """A vocabulary collective over the pipeline ranks: FlopCosts' bytes over their link."""
        if self.vocab == "none":
            return 0.0
        seconds = self.base.collective_time(op)
        if seconds <= 0:
            return 0.0
        size = (seconds - self.base.p2p_latency) * self.base.p2p_bandwidth
        return self.kernels.p2p(size, self.layout.pp_intra)

    def offload_bytes(self, op: Op) -> float:
        key = (op.stage, op.slice)
        if key not in self._offload:
            self._offload[key] = min(self.base.offload_bytes(op), self.activation(op))
        return self._offload[key]

    def copy_time(self, op: Op) -> float:
        return self.kernels.host_copy(self.offload_bytes(op))

    # ---- what the plan adds around the simulation -----------------------------------------------

    def recompute_working_set(self) -> float:
        """Bytes one layer of the largest unit re-materialises during its backward (full
        recompute only): its whole saved activation, held while that layer's backward runs."""
        if self.recompute != "full":
            return 0.0
        parallel = self.layout.parallel
        per_token = parallel.activation(layer_activation_parts(self.shape))
        if any(self.moe_layers):
            per_token = max(per_token, parallel.activation(layer_activation_parts(self.shape, moe=True)))
        return per_token * self.micro_batch_size * max(self.lengths)

    def flops(self, op: Op) -> float:
        """Model FLOPs of a compute op over the whole layer (all TP and CP ranks), no recompute."""
        return self.base.flops(op)

    def layer_seconds(self, j: int = 0) -> LayerTimes:
        return self._layer[j]

    def head_seconds(self, j: int = 0) -> LayerTimes:
        return self._head[j]
