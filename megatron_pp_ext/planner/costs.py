"""The simulator's cost model for one plan: op durations from a device profile, with the tensor-
and context-parallel collectives inside them.

``schedule.flops.FlopCosts`` counts a whole layer's FLOPs on one device and gives TP/CP
collectives no time (docs/memory.md, "Not modelled"). The planner needs both, so this model
keeps FlopCosts for what it gets right (activation bytes under TP/SP/CP, weight-gradient shares,
offload bytes, FLOPs for MFU) and computes durations itself, per layer and slice, on one rank:

* GEMMs of the rank's TP shard over the slice's tokens on its CP rank (``Kernels.gemm``);
* flash attention over the rank's heads and its share of the causal (query, key) pairs;
* bandwidth-bound kernels (norms, SwiGLU, RoPE, residual adds, cross-entropy);
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

Pipeline messages take the link between neighbouring pipeline ranks; activation copies the GPU's
PCIe link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.flops import FlopCosts, head_activation_parts, layer_activation_parts
from ..schedule.ir import Op, OpKind, Schedule
from ..schedule.memory_model import padded_vocab
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
    ) -> None:
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
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
        self.num_stages = schedule.num_stages
        self.microbatch_activation = self.base.microbatch_activation
        self.ranks_per_host = 1
        self._layer = [self._layer_times(j) for j in range(len(lengths))]
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

    def _layer_times(self, j: int) -> LayerTimes:
        s, t, k = self.shape, self.layout.tp, self.kernels
        n, e = self._local_tokens(j), s.bytes_per_element
        gemm = (
            k.gemm(n, (s.q_width + 2 * s.kv_width) / t, s.hidden, e)
            + k.gemm(n, s.hidden, s.q_width / t, e)
            + k.gemm(n, (s.ffn_matrices - 1) * s.ffn / t, s.hidden, e)
            + k.gemm(n, s.hidden, s.ffn / t, e)
        )
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
        sp_split = t if self.layout.parallel.sp else 1
        activation_elements = (3 if s.gated else 2) * s.ffn + 2 * (s.q_width + s.kv_width)
        elementwise = k.memory(e * n * (10 * s.hidden / sp_split + activation_elements / t))
        overhead = self.profile.kernel_overhead
        tp = self._tp_collective(j)
        cp = 0.0
        if self.layout.cp > 1:
            gathered = self.micro_batch_size * self.lengths[j] * 2 * s.kv_width / t * e
            cp = k.collective(gathered, self.layout.cp, self.layout.cp_intra)
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
        forward = gemm + attention_f + elementwise + forward_tp + cp + FORWARD_KERNELS * overhead
        backward_common = attention_b + 2 * elementwise + cp + BACKWARD_KERNELS * overhead
        backward = gemm + backward_common + backward_tp
        weight = gemm + weight_tp
        fused = 2 * gemm + backward_common + fused_tp
        recompute = {"none": 0.0, "selective": attention_f, "full": forward}[self.recompute]
        return LayerTimes(forward, backward, weight, fused, recompute)

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
        total = self.layers[op.stage] * getattr(times, field)
        if op.kind in (OpKind.B, OpKind.BW):
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

    def _activation_of(self, op: Op) -> float:
        full = self.base.activation(op) + self._cp_cache_bytes(op)
        if self.recompute == "none" and self.attention == "unfused":
            full += self.layers[op.stage] * UNFUSED_KEPT_BYTES * self._scores(op.slice)
        if self.recompute != "full":
            return full
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
        return body * kept + head + inputs * self._tokens(op) + self._cp_cache_bytes(op) * kept

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
        per_token = self.layout.parallel.activation(layer_activation_parts(self.shape))
        return per_token * self.micro_batch_size * max(self.lengths)

    def flops(self, op: Op) -> float:
        """Model FLOPs of a compute op over the whole layer (all TP and CP ranks), no recompute."""
        return self.base.flops(op)

    def layer_seconds(self, j: int = 0) -> LayerTimes:
        return self._layer[j]

    def head_seconds(self, j: int = 0) -> LayerTimes:
        return self._head[j]
