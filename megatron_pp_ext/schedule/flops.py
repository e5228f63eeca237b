"""A FLOP-based cost model: op durations and activation bytes of a Llama-style transformer.

Per layer and token of a slice of length s ending at position P (b sequences per microbatch):

* F: the GEMMs, 2 FLOPs per multiply-add over every weight (QKV with GQA-sized K/V, output
  projection, SwiGLU's three or GeLU's two MLP matrices), plus causal attention of the slice's
  queries against every key up to P (bottom-right causal): a(4d+3) FLOPs per (query, key) pair.
* B: the input-gradient GEMMs (as many FLOPs as the forward GEMMs) plus attention backward
  (twice the attention forward).
* W: the weight-gradient GEMMs (as many FLOPs as the forward GEMMs). BW = B + W.

A mixture-of-experts layer (``ModelShape.experts``) counts what a token activates: attention as a
dense layer's, the router (h x E), the shared expert and k routed experts of width f_e, each GEMM
2 FLOPs per multiply-add as above; a stage's ops count its own mix of MoE and dense layers
(``memory_model.stage_moe_layers``). Routing is taken as balanced (every expert gets k/E of the
tokens).

With expert parallelism (EP > 1) each MoE layer's tokens cross the EP ranks in all-to-alls: a
forward's dispatch and combine, a backward's (B or BW) two gradient all-to-alls. Each sends, per
rank, its tokens (b x s / (t if SP) / c) x the routed copies x h in the activation type, less the
1/EP share whose expert is local, at ``ep_bandwidth`` (``expert_comm_time``; default 50 GB/s: one
400 Gb/s InfiniBand NIC per GPU, as in DeepSeek-V3's H800 cluster, whose EP spans nodes). It is
part of the op's duration, hidden only where an overlapped F&B pair runs it behind its partner's
compute (``pairs.hidden_seconds``). Not modelled: DeepSeek-V3's node-limited routing (a token
crosses IB once per node), FP8 dispatch, the expert-TP all-gather, stragglers of unbalanced
routing.

Stage 0 also holds the embedding (a lookup: no FLOPs, no saved activation beyond token ids). The
last stage also holds the final norm, the output layer (2*s*h*V FLOPs each for F, B and W) and the
cross-entropy. Norms, residual adds, RoPE and SiLU are left out of the FLOPs (well under 1%).

With vocabulary parallelism (``vocab_parallel`` ``vocab-1`` or ``vocab-2``, ``vocab.py``) the output
layer leaves the last stage: every rank's S and T run GEMMs of 2*s*h*V/p FLOPs on its shard, one
in S and two in T (vocab-1: logits; input and weight gradient) or two in S and one in T (vocab-2:
logits and the input-gradient partial; weight gradient). The last stage keeps its final-norm
input; an S holds its softmax shard (V/p fp32 per token) and a copy of X until its T. The
collectives move one hidden state (or its gradient, fp32) per unit over the p2p links.

Durations are seconds at ``peak_flops * utilisation``: by default 400 TFLOP/s (a bf16 dense
Hopper-class figure) at 50% utilisation, i.e. 200 TFLOP/s delivered. Pass your own.

Activation offload copies the whole saved activation of a unit over the host link, by default
50 GB/s per direction (pinned copies over PCIe 5.0 x16).

Activation bytes and p2p messages are those of one rank under Megatron's tensor, sequence and
context parallelism (``memory_model.Parallelism``: each per-token count is split into the part
inside the TP region and the part outside it); weights, gradients and optimizer state are in
``memory_model.static_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import offload_ratio
from .ir import COLLECTIVE_KINDS, Op, OpKind, Schedule
from .memory_model import FP32, Parallelism, TokenBytes, stage_moe_layers
from .models import ModelShape, get_model
from .partition import DEFAULT_UNIT, causal_pairs, slice_lengths

# Bytes/s of one rank's expert all-to-all: one 400 Gb/s InfiniBand NIC per GPU, DeepSeek-V3's
# H800 cluster, where expert parallelism spans nodes (its technical report, arXiv 2412.19437,
# sections 3.1 and 3.2.2: "IB (50 GB/s)" beside NVLink's 160 GB/s within a node).
EP_BANDWIDTH = 50e9


def layer_activation_parts(shape: ModelShape, moe: bool = False) -> TokenBytes:
    """Bytes one layer (``moe``: one MoE layer) saves per token for its backward (bf16 unless
    noted), flash attention, no recompute, split by where Megatron keeps them under tensor
    parallelism.

    Outside the TP region (replicated over TP ranks unless sequence parallel):

    * attention-norm input (the residual stream) h, and its output (the QKV GEMM input) h
    * MLP-norm input h, and its output (the gate/up or fc1 GEMM input) h
    * the two RMSNorm reciprocal RMS values in fp32

    Inside it (split over TP ranks by heads or FFN columns):

    * Q, K, V after RoPE: a*d + 2*g*d (GQA: K and V are g*d wide)
    * attention output O: a*d (flash attention's saved output, also the out-projection input)
    * flash-attention log-sum-exp: a values in fp32
    * SwiGLU: gate and up outputs 2f, down-projection input f (GeLU MLP: fc1 output f, fc2 input f)

    An MoE layer keeps the same attention and norm tensors; its MLP's are the shared expert's
    (as a dense MLP of width f_s, inside), the router's softmax over the E experts (fp32,
    outside) and, for each of the k routed copies of the token, the expert's input h and its
    routing probability (fp32) and its FFN intermediates as a dense MLP's of width f_e.
    """
    e = shape.bytes_per_element
    attention = (2 * shape.q_width + 2 * shape.kv_width) * e + shape.heads * FP32
    outside = 4 * shape.hidden * e + 2 * FP32
    if not moe:
        return TokenBytes(inside=attention + shape.ffn_matrices * shape.ffn * e, outside=outside)
    k = shape.routed_copies
    return TokenBytes(
        inside=attention + shape.ffn_matrices * shape.shared_expert_ffn * e,
        outside=outside + shape.experts * FP32,
        routed_outside=k * (shape.hidden * e + FP32),
        routed_inside=k * shape.ffn_matrices * shape.moe_ffn * e,
    )


def layer_activation_bytes_per_token(shape: ModelShape) -> int:
    """Bytes one layer saves per token on one device (no TP/SP/CP): see :func:`layer_activation_parts`."""
    return layer_activation_parts(shape).total


def layer_weight_share_parts(shape: ModelShape, moe: bool = False) -> TokenBytes:
    """Bytes one layer keeps after B until W: the two operands of every weight-gradient GEMM
    (dW = dY^T X), i.e. each linear's input X and the gradient dY of its output.

    QKV: X h, dY a*d + 2*g*d; out projection: X a*d, dY h; gate/up (fc1): X h, dY 2f (f);
    down (fc2): X f, dY h. For a multi-head (g = a) Llama this equals the whole saved activation
    less the fp32 extras: deferring W frees little at B, as the zero-bubble papers note. The four
    h-wide operands lie outside the TP region, the rest inside.

    An MoE layer: the router's dY (E logits) joins the four h-wide operands; the shared expert
    is a dense MLP of width f_s; each routed copy keeps its expert's fc1 input and fc2 output
    gradient (2h) and the FFN operands of width f_e.
    """
    e = shape.bytes_per_element
    attention = 2 * shape.q_width + 2 * shape.kv_width
    if not moe:
        return TokenBytes(
            inside=(attention + shape.ffn_matrices * shape.ffn) * e, outside=4 * shape.hidden * e
        )
    k = shape.routed_copies
    return TokenBytes(
        inside=(attention + shape.ffn_matrices * shape.shared_expert_ffn) * e,
        outside=(4 * shape.hidden + shape.experts) * e,
        routed_outside=k * 2 * shape.hidden * e,
        routed_inside=k * shape.ffn_matrices * shape.moe_ffn * e,
    )


def layer_weight_share_bytes_per_token(shape: ModelShape) -> int:
    """Weight-gradient operands of one layer per token on one device: see :func:`layer_weight_share_parts`."""
    return layer_weight_share_parts(shape).total


def head_layers(shape: ModelShape, seq_length: int) -> float:
    """The output layer's GEMM work in layers (forward, per token, causal attention averaged over
    the sequence): what the last pipeline stage carries beyond its layers. Llama 3 8B at 8K: 2.0;
    Llama 3 405B: 0.6."""
    layer = shape.layer_linear_flops_per_token() + shape.attention_flops_per_pair() * (seq_length + 1) / 2
    return 2 * shape.hidden * shape.vocab / layer


def head_activation_parts(shape: ModelShape) -> TokenBytes:
    """Last stage extras per token: final-norm input h and output-layer input h (bf16, outside the
    TP region) and the softmax of the logits that cross-entropy keeps for its backward, V values in
    fp32 (vocab-parallel: inside)."""
    return TokenBytes(inside=shape.vocab * FP32, outside=2 * shape.hidden * shape.bytes_per_element)


def head_activation_bytes_per_token(shape: ModelShape) -> int:
    return head_activation_parts(shape).total


def head_weight_share_parts(shape: ModelShape) -> TokenBytes:
    """Output-layer weight gradient operands per token: its input h and the logits' gradient V."""
    return TokenBytes(inside=shape.vocab * FP32, outside=shape.hidden * shape.bytes_per_element)


def head_weight_share_bytes_per_token(shape: ModelShape) -> int:
    return head_weight_share_parts(shape).total


def even_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; the first stages take the remainder so the last
    stage, which also runs the output layer, stays the lightest."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


@dataclass
class FlopCosts:
    """CostModel for ``shape`` at ``seq_length`` tokens, ``micro_batch_size`` sequences per
    microbatch, split over ``num_stages`` virtual stages. Times in seconds, memory in bytes.

    ``parallel`` shards the activations and p2p messages of one rank as Megatron's TP/SP/CP do
    (see ``memory_model.Parallelism``); op durations still count a whole layer's FLOPs."""

    shape: ModelShape
    seq_length: int
    num_stages: int
    micro_batch_size: int = 1
    slice_lengths: list[int] | None = None  # default: one slice, the whole sequence
    layers_per_stage: list[int] | None = None  # default: even_layers(shape.layers, num_stages)
    peak_flops: float = 400e12  # FLOP/s of one GPU
    utilisation: float = 0.5  # share of the peak that GEMMs and attention actually reach
    p2p_bandwidth: float = 50e9  # bytes/s between neighbouring pipeline ranks
    p2p_latency: float = 10e-6  # seconds per message
    host_bandwidth: float = 50e9  # bytes/s of one device's host link, each direction
    ranks_per_host: int = 1  # ranks that share one host link
    parallel: Parallelism = field(default_factory=Parallelism)
    vocab_parallel: str = "none"  # "vocab-1" / "vocab-2": the output layer runs as S and T on every rank
    pipeline_ranks: int | None = None  # p, the ranks the vocabulary is split over (default: num_stages)
    ep_bandwidth: float = EP_BANDWIDTH  # bytes/s of one rank's expert all-to-all (EP > 1)
    microbatch_activation: float = field(init=False)

    def __post_init__(self) -> None:
        if self.slice_lengths is None:
            self.slice_lengths = [self.seq_length]
        if sum(self.slice_lengths) != self.seq_length or min(self.slice_lengths) < 1:
            raise ValueError(
                f"slice lengths {self.slice_lengths} must be positive and sum to --seq-length "
                f"{self.seq_length}"
            )
        if self.layers_per_stage is None:
            self.layers_per_stage = even_layers(self.shape.layers, self.num_stages)
        if len(self.layers_per_stage) != self.num_stages:
            raise ValueError(
                f"layers_per_stage lists {len(self.layers_per_stage)} stages, the schedule has "
                f"{self.num_stages}"
            )
        rates = (self.peak_flops * self.utilisation, self.p2p_bandwidth, self.host_bandwidth)
        if not all(rate > 0 for rate in (*rates, self.ep_bandwidth)):
            raise ValueError(
                "peak_flops, utilisation, p2p_bandwidth, host_bandwidth and ep_bandwidth must be positive"
            )
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be at least 1, got {self.ranks_per_host}")
        if self.vocab_parallel not in ("none", "vocab-1", "vocab-2"):
            raise ValueError(f"vocab_parallel must be none, vocab-1 or vocab-2, got {self.vocab_parallel!r}")
        if self.pipeline_ranks is None:
            self.pipeline_ranks = self.num_stages
        self._ends = [sum(self.slice_lengths[: j + 1]) for j in range(len(self.slice_lengths))]
        self._moe_layers = stage_moe_layers(self.shape, self.layers_per_stage)
        moe = sum(self._moe_layers)
        dense = sum(self.layers_per_stage) - moe
        b, s = self.micro_batch_size, self.seq_length
        self.microbatch_activation = float(
            dense * b * s * self.parallel.activation(layer_activation_parts(self.shape))
            + moe * b * s * self.parallel.activation(layer_activation_parts(self.shape, moe=True))
        )

    def _per_layer(self, stage: int, dense: float, moe: float) -> float:
        """A stage's total of ``dense`` per dense layer and ``moe`` per MoE layer."""
        moe_layers = self._moe_layers[stage]
        return (self.layers_per_stage[stage] - moe_layers) * dense + moe_layers * moe

    # ---- FLOPs ---------------------------------------------------------------------------

    def _tokens(self, op: Op) -> int:
        return self.micro_batch_size * self.slice_lengths[op.slice]

    def _layers_gemm_flops(self, op: Op) -> float:
        """GEMM FLOPs of the op's stage's layers (dense and MoE) over its tokens."""
        tokens = self._tokens(op)
        dense = float(self.shape.layer_linear_flops_per_token() * tokens)
        return self._per_layer(op.stage, dense, self.shape.moe_layer_linear_flops_per_token() * tokens)

    def _layer_attention_flops(self, op: Op) -> float:
        pairs = causal_pairs(self.slice_lengths[op.slice], self._ends[op.slice])
        return float(self.shape.attention_flops_per_pair() * pairs * self.micro_batch_size)

    @property
    def splits_vocab(self) -> bool:
        return self.vocab_parallel != "none"

    def _head_gemm_flops(self, op: Op) -> float:
        if op.stage != self.num_stages - 1 or self.splits_vocab:
            return 0.0
        return float(2 * self._tokens(op) * self.shape.hidden * self.shape.vocab)

    def vocab_gemm_flops(self, op: Op) -> float:
        """One output-layer GEMM of a rank's vocabulary shard for ``op``'s unit: 2*s*h*V/p."""
        return 2.0 * self._tokens(op) * self.shape.hidden * self.shape.vocab / (self.pipeline_ranks or 1)

    def flops(self, op: Op) -> float:
        """FLOPs of a compute op (0 for communication ops)."""
        if op.kind in (OpKind.S, OpKind.T):
            s_gemms, t_gemms = (2, 1) if self.vocab_parallel == "vocab-2" else (1, 2)
            return (s_gemms if op.kind == OpKind.S else t_gemms) * self.vocab_gemm_flops(op)
        if op.kind not in (OpKind.F, OpKind.B, OpKind.W, OpKind.BW):
            return 0.0
        gemm = self._layers_gemm_flops(op) + self._head_gemm_flops(op)
        attention = self.layers_per_stage[op.stage] * self._layer_attention_flops(op)
        if op.kind == OpKind.F:
            return gemm + attention
        if op.kind == OpKind.B:
            return gemm + 2 * attention
        if op.kind == OpKind.W:
            return gemm
        if op.kind == OpKind.BW:
            return 2 * gemm + 2 * attention
        return 0.0

    # ---- CostModel -----------------------------------------------------------------------

    def duration(self, op: Op) -> float:
        """Compute at the delivered FLOP rate plus the expert all-to-alls, exposed unless an
        overlapped pair hides them (as ``UniformCosts.duration``)."""
        return self.flops(op) / (self.peak_flops * self.utilisation) + self.expert_comm_time(op)

    def expert_alltoall_bytes(self, op: Op) -> float:
        """Bytes one rank sends in one expert all-to-all of ``op``'s unit: its tokens (b x s, / t
        under SP, / c) x the routed copies (k, or what a capacity factor keeps) x h in the
        activation type, x (EP-1)/EP, the share routed to experts on other EP ranks under
        balanced routing. 0 for a dense model or EP 1: no token leaves the rank."""
        ep = self.parallel.ep
        if not self.shape.experts or ep <= 1:
            return 0.0
        tokens = self._tokens(op) / self.parallel.sequence_split
        per_token = self.shape.routed_copies * self.shape.hidden * self.shape.bytes_per_element
        return tokens * per_token * (ep - 1) / ep

    def expert_comm_time(self, op: Op) -> float:
        """Seconds of ``op``'s expert all-to-alls: two per MoE layer of its stage for an F
        (dispatch, combine) and for a B or BW (their gradients); 0 for W and the rest, whose
        GEMMs move no tokens. With TP or CP > 1 this is one rank's share while the compute in
        ``duration`` is the whole layer's, so the a2a looks smaller beside it than it is."""
        if op.kind not in (OpKind.F, OpKind.B, OpKind.BW):
            return 0.0
        alltoalls = 2 * self._moe_layers[op.stage]
        return alltoalls * self.expert_alltoall_bytes(op) / self.ep_bandwidth

    def _bytes(self, op: Op, per_layer: TokenBytes, per_moe_layer: TokenBytes, head: TokenBytes) -> float:
        activation = self.parallel.activation
        per_token = self._per_layer(op.stage, activation(per_layer), activation(per_moe_layer))
        if op.stage == self.num_stages - 1:
            per_token += self.parallel.activation(head)
        return per_token * self._tokens(op)

    def activation(self, op: Op) -> float:
        # With the vocabulary split, the last stage keeps only its final-norm input.
        head = TokenBytes(0, self.shape.hidden * self.shape.bytes_per_element)
        return self._bytes(
            op,
            layer_activation_parts(self.shape),
            layer_activation_parts(self.shape, moe=True),
            head if self.splits_vocab else head_activation_parts(self.shape),
        )

    def weight_share(self, op: Op) -> float:
        head = TokenBytes(0, 0) if self.splits_vocab else head_weight_share_parts(self.shape)
        moe = layer_weight_share_parts(self.shape, moe=True)
        return self._bytes(op, layer_weight_share_parts(self.shape), moe, head)

    def vocab_activation(self, op: Op) -> float:
        """What an S keeps until its T: the softmax shard (V/p fp32 per token, inside the TP
        region) and the copy of X (h per token); vocab-2 adds its two input-gradient partials
        (h fp32 each), which the collective after S consumes."""
        shard = -(-self.shape.vocab // (self.pipeline_ranks or 1))
        outside = self.shape.hidden * self.shape.bytes_per_element
        if self.vocab_parallel == "vocab-2":
            outside += 2 * self.shape.hidden * FP32
        return self.parallel.activation(TokenBytes(inside=shard * FP32, outside=outside)) * self._tokens(op)

    def collective_time(self, op: Op) -> float:
        """One collective over the pipeline ranks once all issued it: its bytes over the p2p
        bandwidth plus one latency. X goes with its labels and loss gradient (12 bytes a token);
        the statistics are 3 fp32 per token from each of the p ranks; input-gradient partials are
        fp32; embeddings and their gradients in the activation type; token ids int64."""
        if op.kind not in COLLECTIVE_KINDS:
            return 0.0
        tokens = self._tokens(op)
        hidden = tokens * self.shape.hidden / self.parallel.sequence_split
        element = self.shape.bytes_per_element
        stats = 3 * FP32 * tokens * (self.pipeline_ranks or 1) / self.parallel.cp
        size = {
            OpKind.BCAST_X: hidden * element + 12 * tokens / self.parallel.cp,
            OpKind.REDUCE_S: stats + (hidden * FP32 if self.vocab_parallel == "vocab-2" else 0.0),
            OpKind.REDUCE_T: hidden * FP32,
            OpKind.BCAST_IDS: 8.0 * tokens,
            OpKind.REDUCE_EMB: hidden * element,
            OpKind.BCAST_DEMB: hidden * element,
        }[op.kind]
        return size / self.p2p_bandwidth + self.p2p_latency

    def comm_latency(self, op: Op) -> float:
        """One hidden-state tensor (or its gradient) of the op's slice: (s / (t if SP) / c) x b x h
        elements, the piece of it one TP/CP rank sends."""
        size = (
            self._tokens(op) * self.shape.hidden * self.shape.bytes_per_element / self.parallel.sequence_split
        )
        return size / self.p2p_bandwidth + self.p2p_latency

    def offload_bytes(self, op: Op) -> float:
        """An OFFLOAD copies the unit's whole saved activation."""
        return self.activation(op)

    def copy_time(self, op: Op) -> float:
        return self.offload_bytes(op) / self.host_bandwidth

    def offload_ratio(self) -> float:
        """PipeOffload's k for this model and sequence length, with each rank's share of its
        host link (the ``ranks_per_host`` ranks of a host split it)."""
        return offload_ratio(
            self.shape.hidden,
            self.seq_length,
            self.peak_flops * self.utilisation,
            self.host_bandwidth / self.ranks_per_host,
        )


def flop_costs_for(
    model: str | ModelShape,
    schedule: Schedule,
    seq_length: int,
    micro_batch_size: int = 1,
    partition: str = "uniform",
    unit: int = DEFAULT_UNIT,
    parallel: Parallelism | None = None,
    layers_per_stage: list[int] | None = None,
    **options: float | str,
) -> FlopCosts:
    """FlopCosts sized for ``schedule`` (its stages, ranks and slices), cutting the sequence the
    way ``partition`` says; ``vocab_parallel`` defaults to the schedule's own vocabulary passes.
    Unknown model names raise KeyError; bad cuts raise PartitionError."""
    shape = get_model(model) if isinstance(model, str) else model
    lengths = slice_lengths(partition, shape, seq_length, schedule.slices, unit)
    options.setdefault("vocab_parallel", schedule.vocab_parallel)  # type: ignore[arg-type]
    return FlopCosts(
        shape=shape,
        seq_length=seq_length,
        num_stages=schedule.num_stages,
        micro_batch_size=micro_batch_size,
        slice_lengths=lengths,
        layers_per_stage=layers_per_stage,
        parallel=parallel or Parallelism(),
        pipeline_ranks=schedule.pp,
        **options,  # type: ignore[arg-type]
    )
