#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py (patched by scripts/setup_megatron_lm.sh) with megatron_pp_ext's
# pipeline schedules, on a SLURM cluster. The sbatch files next to this one set a model config and
# a parallel layout and source this file; it can also be run by hand inside an allocation:
#
#   CONFIG=llama3-8b PP_SCHEDULE=zb-h2 scripts/slurm/launch.sh [--dry-run] [-- MORE MEGATRON FLAGS]
#
# --dry-run prints the environment, the srun line and the full pretrain_gpt.py command line and
# exits; it needs no SLURM (NNODES and GPUS_PER_NODE stand in for the allocation).
#
# Everything is a variable with a default; the environment overrides it:
#   CONFIG           a name in configs/ (llama2-70b, llama3-8b, gpt3-175b, ...) or a YAML file
#   CLUSTER          hopper | a100: NCCL defaults for the machine (default hopper)
#   NNODES, GPUS_PER_NODE   default: the allocation's (SLURM_JOB_NUM_NODES, SLURM_GPUS_ON_NODE), else 1 x 8
#   SEQ_LENGTH       tokens per sequence (default: the config's); MAX_POSITION_EMBEDDINGS, ROTARY_BASE
#   TP PP CP SEQUENCE_PARALLEL MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE   (default: the config's training
#                    section; DP = NNODES x GPUS_PER_NODE / (TP x PP x CP), as Megatron derives it)
#   TRAIN_ITERS LR MIN_LR WARMUP_ITERS WEIGHT_DECAY CLIP_GRAD SEED   (default: the config's)
#   PP_SCHEDULE PP_CHUNKS PP_SEQ_SLICES PP_SLICE_PARTITION   (default: the config's pipeline section)
#   PP_OFFLOAD (none|full|selective|auto), PP_ATTN_REDISTRIBUTION (0..1)
#   TRANSFORMER_IMPL transformer_engine (default; B/W-split schedules need TE >= 2.3) | local
#   USE_DISTRIBUTED_OPTIMIZER OVERLAP_GRAD_REDUCE (0|1, default: the config's), OVERLAP_PARAM_GATHER
#                    (0|1, default 0: Megatron's --overlap-param-gather, with the distributed optimizer)
#   DATA_PATH        Megatron data prefix(es) (a blend "0.7 /data/a_text_document 0.3 /data/b...");
#                    unset: --mock-data with a NullTokenizer of the config's vocabulary
#   TOKENIZER        with DATA_PATH: the tokenizer model (a Hugging Face name or directory, e.g.
#                    meta-llama/Llama-2-70b-hf); TOKENIZER_TYPE (default HuggingFaceTokenizer), SPLIT
#   RUN_ROOT         where each job writes RUN_ROOT/<job name>-<job id>/{logs,checkpoints,tensorboard}
#                    (default: $SLURM_SUBMIT_DIR/runs); LOAD_DIR: checkpoints to resume from (default:
#                    the job's own); SAVE_INTERVAL, EVAL_INTERVAL, EVAL_ITERS
#   MEGATRON_LM      the patched Megatron-LM checkout (default /opt/Megatron-LM, the image's)
#   CONTAINER_IMAGE  pyxis/enroot image (default $SLURM_SUBMIT_DIR/megatron-pp-ext.sqsh, made with
#                    `docker build -t megatron-pp-ext . && enroot import -o megatron-pp-ext.sqsh
#                    dockerd://megatron-pp-ext`); "none": no container, run on the host's Python
#   CONTAINER_MOUNTS pyxis mounts (default RUN_ROOT, plus DATA_DIR when set)
#   LAUNCHER         srun: one task per GPU, ranks from SLURM_PROCID/SLURM_LOCALID (default in a
#                    container); torchrun: one task per node, torchrun with a c10d rendezvous on the
#                    first node (default without a container)
#   NCCL_*           site settings (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX for RoCE) are
#                    passed through when set; see cluster_environment below for the defaults
set -euo pipefail

DRY_RUN=0
EXTRA_ARGS=()
while (($#)); do
    case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA_ARGS+=("$@"); break ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) EXTRA_ARGS+=("$1") ;;
    esac
    shift
done

die() { echo "launch.sh: error: $*" >&2; exit 2; }

SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=${MEGATRON_PP_EXT:-$(cd "$SLURM_DIR/../.." && pwd)}
PYTHON=${PYTHON:-python3} # reads the config (PyYAML optional): Python >= 3.10 with no other packages
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null ||
    die "'$PYTHON' is not Python >= 3.10: set PYTHON to one (it only reads the model config)"
: "${CONFIG:?set CONFIG to a name in configs/ or a YAML file}"

# ---- the model config ---------------------------------------------------------------------------
config_cmd=("$PYTHON" -m megatron_pp_ext.configs)
cfg_flags=()
[[ -n "${SEQ_LENGTH:-}" ]] && cfg_flags+=(--seq-length "$SEQ_LENGTH")
[[ -n "${MAX_POSITION_EMBEDDINGS:-}" ]] && cfg_flags+=(--max-position-embeddings "$MAX_POSITION_EMBEDDINGS")
[[ -n "${ROTARY_BASE:-}" ]] && cfg_flags+=(--rotary-base "$ROTARY_BASE")
cfg_shell=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "${config_cmd[@]}" shell "$CONFIG" "${cfg_flags[@]}") ||
    exit 2
eval "$cfg_shell"

: "${SEQ_LENGTH:=$CFG_SEQ_LENGTH}"
: "${TP:=$CFG_TP}" "${PP:=$CFG_PP}" "${CP:=$CFG_CP}" "${SEQUENCE_PARALLEL:=$CFG_SEQUENCE_PARALLEL}"
: "${MICRO_BATCH_SIZE:=$CFG_MICRO_BATCH_SIZE}" "${GLOBAL_BATCH_SIZE:=$CFG_GLOBAL_BATCH_SIZE}"
: "${TRAIN_ITERS:=$CFG_TRAIN_ITERS}" "${LR:=$CFG_LR}" "${MIN_LR:=$CFG_MIN_LR}" "${WARMUP_ITERS:=$CFG_WARMUP_ITERS}"
: "${WEIGHT_DECAY:=$CFG_WEIGHT_DECAY}" "${CLIP_GRAD:=$CFG_CLIP_GRAD}" "${SEED:=$CFG_SEED}"
: "${LOG_INTERVAL:=$CFG_LOG_INTERVAL}"
: "${USE_DISTRIBUTED_OPTIMIZER:=$CFG_USE_DISTRIBUTED_OPTIMIZER}" "${OVERLAP_GRAD_REDUCE:=$CFG_OVERLAP_GRAD_REDUCE}"
: "${OVERLAP_PARAM_GATHER:=0}"
: "${PP_SCHEDULE:=$CFG_PP_SCHEDULE}" "${PP_CHUNKS:=$CFG_PP_CHUNKS}" "${PP_SEQ_SLICES:=$CFG_PP_SEQ_SLICES}"
: "${PP_SLICE_PARTITION:=$CFG_PP_SLICE_PARTITION}" "${PP_OFFLOAD:=none}" "${PP_ATTN_REDISTRIBUTION:=}"
: "${CLUSTER:=hopper}"

# ---- the allocation and the layout --------------------------------------------------------------
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
MODEL_PARALLEL=$((TP * PP * CP))
((WORLD_SIZE % MODEL_PARALLEL == 0)) ||
    die "$NNODES nodes x $GPUS_PER_NODE GPUs = $WORLD_SIZE is not a multiple of TP x PP x CP = $TP x $PP x $CP"
DP=$((WORLD_SIZE / MODEL_PARALLEL))
[[ -n "$GLOBAL_BATCH_SIZE" ]] || GLOBAL_BATCH_SIZE=$((MICRO_BATCH_SIZE * DP))
((GLOBAL_BATCH_SIZE % (MICRO_BATCH_SIZE * DP) == 0)) ||
    die "GLOBAL_BATCH_SIZE $GLOBAL_BATCH_SIZE is not a multiple of MICRO_BATCH_SIZE x DP = $MICRO_BATCH_SIZE x $DP"
MICROBATCHES=$((GLOBAL_BATCH_SIZE / (MICRO_BATCH_SIZE * DP)))

# The schedule the hook will run, generated here so a bad layout fails before the job starts.
check_flags=(--pipeline-model-parallel-size "$PP" --microbatches "$MICROBATCHES" --pp-schedule "$PP_SCHEDULE"
    --pp-seq-slices "$PP_SEQ_SLICES" --seq-length "$SEQ_LENGTH")
[[ -n "$PP_CHUNKS" ]] && check_flags+=(--pp-chunks "$PP_CHUNKS")
[[ -n "$PP_SLICE_PARTITION" ]] && check_flags+=(--pp-slice-partition "$PP_SLICE_PARTITION")
layout=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "${config_cmd[@]}" check "$CONFIG" "${check_flags[@]}") ||
    exit 2
eval "$layout" # LAYOUT_CHUNKS, LAYOUT_SLICES, LAYOUT_SLICE_LENGTHS, LAYOUT_SPLITS_BACKWARD

# ---- per-job directories ------------------------------------------------------------------------
JOB_ID=${SLURM_JOB_ID:-dryrun}
JOB_NAME=${SLURM_JOB_NAME:-$(basename "$0")} # the sbatch file's name, or its --job-name
JOB_NAME=${JOB_NAME%.sbatch}
[[ "$JOB_NAME" == launch.sh ]] && JOB_NAME=$CFG_NAME
RUN_ROOT=${RUN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/runs}
RUN_DIR=$RUN_ROOT/$JOB_NAME-$JOB_ID
CKPT_DIR=$RUN_DIR/checkpoints
LOAD_DIR=${LOAD_DIR:-$CKPT_DIR}
DATA_CACHE=${DATA_CACHE:-$RUN_ROOT/data-cache}
MEGATRON_LM=${MEGATRON_LM:-/opt/Megatron-LM}

# ---- the environment ----------------------------------------------------------------------------
ENV_NAMES=()
setenv() { # setenv NAME DEFAULT: keep the caller's value, else the default; export and remember
    local name=$1
    [[ -n "${!name:-}" ]] || printf -v "$name" '%s' "$2"
    export "${name?}"
    ENV_NAMES+=("$name")
}
cluster_environment() {
    setenv CUDA_DEVICE_MAX_CONNECTIONS 1 # TP/SP/CP: Megatron requires it before Blackwell
    setenv TORCH_NCCL_ASYNC_ERROR_HANDLING 1
    setenv TORCH_NCCL_AVOID_RECORD_STREAMS 1
    setenv PYTORCH_CUDA_ALLOC_CONF expandable_segments:True # long sequences fragment the caching allocator
    setenv NCCL_DEBUG WARN
    setenv NCCL_IB_TIMEOUT 22     # 4.096 us x 2^22: ride out fabric hiccups on big jobs
    setenv NCCL_IB_RETRY_CNT 7
    setenv NCCL_IB_SL 0
    setenv NCCL_P2P_NET_CHUNKSIZE 2097152 # pipeline sends between nodes: bigger chunks
    case "$CLUSTER" in
    hopper) # H100/H200 (SXM, NVSwitch, ConnectX-7 NDR): one 400G NIC per GPU
        GPU_ARCH=9.0
        setenv NCCL_IB_QPS_PER_CONNECTION 2
        setenv NCCL_NVLS_ENABLE 0 # NVLink SHARP buffers cost GPU memory that long sequences need
        ;;
    a100) # A100 (SXM4, NVSwitch, ConnectX-6 HDR): NCCL finds the HCAs; set NCCL_IB_HCA if it does not
        GPU_ARCH=8.0
        setenv NCCL_IB_QPS_PER_CONNECTION 1
        ;;
    *) die "CLUSTER must be hopper or a100, got '$CLUSTER'" ;;
    esac
    local name
    for name in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_IB_DISABLE NCCL_NET_GDR_LEVEL UCX_NET_DEVICES; do
        [[ -n "${!name:-}" ]] && setenv "$name" "${!name}"
    done
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        setenv MASTER_ADDR "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    else
        setenv MASTER_ADDR localhost
    fi
    setenv MASTER_PORT $((20000 + ${SLURM_JOB_ID:-0} % 20000))
}
cluster_environment

# ---- Megatron-LM's command line -----------------------------------------------------------------
ARGS=("${CFG_MODEL_ARGS[@]}")
ARGS+=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --context-parallel-size "$CP")
((TP > 1)) && [[ "$SEQUENCE_PARALLEL" == 1 ]] && ARGS+=(--sequence-parallel)
if ((LAYOUT_CHUNKS > 1)); then
    # Megatron builds that many model chunks per rank; --pp-chunks says the same to the plugin.
    # Megatron's own interleaved p2p overlap does not apply to our schedules (and needs PP > 2 off).
    ARGS+=(--num-virtual-stages-per-pipeline-rank "$LAYOUT_CHUNKS")
    ((PP > 2)) && ARGS+=(--no-overlap-p2p-communication)
fi
ARGS+=(--pp-schedule "$PP_SCHEDULE")
((LAYOUT_CHUNKS > 1)) && ARGS+=(--pp-chunks "$LAYOUT_CHUNKS")
((LAYOUT_SLICES > 1)) && ARGS+=(--pp-seq-slices "$LAYOUT_SLICES")
[[ -n "$PP_SLICE_PARTITION" ]] && ARGS+=(--pp-slice-partition "$PP_SLICE_PARTITION")
[[ "$PP_OFFLOAD" != none ]] && ARGS+=(--pp-offload "$PP_OFFLOAD")
[[ -n "$PP_ATTN_REDISTRIBUTION" ]] && ARGS+=(--pp-attn-redistribution "$PP_ATTN_REDISTRIBUTION")
# Transformer Engine's spec for every schedule (Megatron's default): schedules that split backward
# into B and W (zb-*, v-*) run W through TE's own deferred weight gradient, which needs TE >= 2.3
# (the plugin refuses an older one at start-up, naming it). TRANSFORMER_IMPL=local for the plugin's
# own deferrable linears with SDPA attention.
ARGS+=(--transformer-impl "${TRANSFORMER_IMPL:-transformer_engine}")
ARGS+=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-warmup-iters "$WARMUP_ITERS" --weight-decay "$WEIGHT_DECAY" --adam-beta1 0.9 --adam-beta2 0.95
    --clip-grad "$CLIP_GRAD" --seed "$SEED"
)
[[ "$USE_DISTRIBUTED_OPTIMIZER" == 1 ]] && ARGS+=(--use-distributed-optimizer)
[[ "$OVERLAP_GRAD_REDUCE" == 1 ]] && ARGS+=(--overlap-grad-reduce)
[[ "$OVERLAP_PARAM_GATHER" == 1 ]] && ARGS+=(--overlap-param-gather)
if [[ -n "${DATA_PATH:-}" ]]; then
    [[ -n "${TOKENIZER:-}" ]] || die "DATA_PATH needs TOKENIZER (the tokenizer model of the data)"
    read -r -a data_prefixes <<<"$DATA_PATH"
    ARGS+=(--data-path "${data_prefixes[@]}" --split "${SPLIT:-99,1,0}"
        --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "$TOKENIZER")
else
    ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$CFG_VOCAB_SIZE")
fi
# A [S, S] attention mask per sample is 16 GiB at 128K tokens: causal masking happens in the kernel.
ARGS+=(--data-cache-path "$DATA_CACHE" --no-create-attention-mask-in-dataloader --num-workers "${NUM_WORKERS:-2}")
ARGS+=(
    --log-interval "$LOG_INTERVAL" --log-throughput --tensorboard-dir "$RUN_DIR/tensorboard"
    --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    --save "$CKPT_DIR" --load "$LOAD_DIR" --save-interval "${SAVE_INTERVAL:-1000}" --ckpt-format torch_dist
    --distributed-timeout-minutes "${DISTRIBUTED_TIMEOUT_MINUTES:-60}"
    # the same deadline for our pipeline's waits (receives, vocabulary collectives, warm-up)
    --pp-p2p-timeout "$(( ${DISTRIBUTED_TIMEOUT_MINUTES:-60} * 60 ))"
)
ARGS+=("${EXTRA_ARGS[@]}")
TRAIN=(python "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}")

# ---- srun ---------------------------------------------------------------------------------------
CONTAINER_IMAGE=${CONTAINER_IMAGE-${SLURM_SUBMIT_DIR:-$PWD}/megatron-pp-ext.sqsh}
[[ "$CONTAINER_IMAGE" == none ]] && CONTAINER_IMAGE=
if [[ -n "$CONTAINER_IMAGE" ]]; then
    LAUNCHER=${LAUNCHER:-srun}
    mounts=${CONTAINER_MOUNTS:-$RUN_ROOT:$RUN_ROOT${DATA_DIR:+,$DATA_DIR:$DATA_DIR}}
    CONTAINER=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts" --container-workdir="$MEGATRON_LM")
else
    LAUNCHER=${LAUNCHER:-torchrun}
    CONTAINER=()
fi
SRUN=(srun --nodes="$NNODES" --kill-on-bad-exit=1 --cpu-bind=none --output="$RUN_DIR/logs/%x-%j-node%n.log"
    "${CONTAINER[@]}")
case "$LAUNCHER" in
srun) # one task per GPU; Megatron reads RANK, LOCAL_RANK and WORLD_SIZE
    SRUN+=(--ntasks-per-node="$GPUS_PER_NODE")
    COMMAND=("${SRUN[@]}" bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"' srun-task "${TRAIN[@]}")
    ;;
torchrun) # one task per node; torchrun starts the GPU processes, rendezvous on the first node
    SRUN+=(--ntasks-per-node=1)
    COMMAND=("${SRUN[@]}" torchrun --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
        --rdzv-id="$JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
        "${TRAIN[@]:1}")
    ;;
*) die "LAUNCHER must be srun or torchrun, got '$LAUNCHER'" ;;
esac

summary() {
    echo "# megatron-pp-ext: $CFG_NAME ($CFG_PARAMETERS parameters) at $SEQ_LENGTH tokens on $NNODES nodes x $GPUS_PER_NODE GPUs ($CLUSTER, compute capability $GPU_ARCH)"
    echo "# layout: TP$TP CP$CP PP$PP DP$DP, $PP_SCHEDULE with $LAYOUT_CHUNKS chunk(s) per rank and $LAYOUT_SLICES slice(s) of $LAYOUT_SLICE_LENGTHS tokens, $MICROBATCHES microbatches of $MICRO_BATCH_SIZE per DP rank, activation offload: $PP_OFFLOAD"
    echo "# run directory: $RUN_DIR (logs, checkpoints, tensorboard); launcher: $LAUNCHER${CONTAINER_IMAGE:+ in $CONTAINER_IMAGE}"
    local name
    for name in "${ENV_NAMES[@]}"; do
        printf 'export %s=%q\n' "$name" "${!name}"
    done
}

if ((DRY_RUN)); then
    summary
    printf '%q ' "${COMMAND[@]}"
    echo
    exit 0
fi

[[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a SLURM allocation (sbatch this, or use --dry-run)"
if [[ "$CONTAINER_IMAGE" == /* && ! -e "$CONTAINER_IMAGE" ]]; then
    die "no container image $CONTAINER_IMAGE: build it (docker build -t megatron-pp-ext . && enroot import -o $CONTAINER_IMAGE dockerd://megatron-pp-ext), point CONTAINER_IMAGE at one, or CONTAINER_IMAGE=none"
fi
mkdir -p "$RUN_DIR/logs" "$CKPT_DIR" "$RUN_DIR/tensorboard" "$DATA_CACHE"
summary | tee "$RUN_DIR/launch.txt"
printf '%q ' "${COMMAND[@]}" | tee -a "$RUN_DIR/launch.txt"
echo | tee -a "$RUN_DIR/launch.txt"
exec "${COMMAND[@]}"
