#!/usr/bin/env bash
# gpu_validate.sh: validate a GPU machine for megatron_pp_ext, in rounds of at most 8 minutes (one
# command each, so that a rerun of one failing round still fits a 15-minute booking), or phase by
# phase.
#
#   scripts/gpu_validate.sh ROUND              run one round: round-1 .. round-5, each one command of
#                                              at most 8 min on an H100 (its steps' time limits and the
#                                              setup sum to 8 min at most)
#   scripts/gpu_validate.sh PHASE [PHASE...]   run these phases in the order given (rounds and phases
#                                              may be mixed; each runs in the order given)
#   scripts/gpu_validate.sh all                every phase (more than one 10-minute call's worth)
#   scripts/gpu_validate.sh --dry-run          list the phases (what each checks, whether it needs a
#                                              GPU, which packages, roughly how long), then the rounds
#                                              (their parts in order, each part's time limit and
#                                              command, the round's minutes and files back); runs
#                                              nothing, needs neither a GPU nor torch
#   scripts/gpu_validate.sh --help
#
# The rounds (docs/benchmarks.md, "GPU rounds", says for each the command, what comes back, what
# pass looks like and where each figure goes):
#   round-1  first contact: preflight (each risky primitive once, gloo with host-staged CUDA
#            tensors), probe, train at PP 1 (1f1b, zb-h1, seq1f1b k=4, interleaved with offload),
#            B-then-W against BW, attention memory, a PP 2 canary with the ranks sharing the GPU
#   round-2  every schedule family at PP 2-4 on the one GPU against PP 1 (families first, then the
#            variants, as many as fit), then sliced attention against one unsliced flash call at 16K-128K
#   round-3  Megatron-LM's patched pretrain_gpt.py (zb-h1, seq1f1b k=2; world 1, NCCL, bf16, mock
#            data, 4 iterations), then activation offload under TORCH_CUDA_SANITIZER=1
#   round-4  bench --against megatron at PP 2 on the medium model (9 schedules), then optimizer
#            post-validation against the same optimizer without it over 200 bf16 steps
#   round-5  the MoE model (4 experts, top-2, EP 2, PP 2, DP 2) under dualpipev and zb-h1, the ranks
#            sharing the GPU over gloo
#
# A phase runs a few steps; a step is one command (most are the short scripts in scripts/gpu/,
# each says in its docstring what it checks and why) and ends PASS, FAIL or SKIP with its reason
# (SKIP: a prerequisite is missing, and the line names it). A failed step never stops the next. A
# round is a list of PHASE/STEP parts, each with its own time limit (the table in round_parts;
# some steps exist only for a round: their phase passes them over). Each phase writes its output
# to $OUT/PHASE.log (in a round: $OUT/ROUND-PHASE.log) and appends a block to $DOCS: a heading
# "## GPU validation, <date> (<device>)" with the date (UTC), the device (nvidia-smi), the
# versions (python, torch, CUDA, megatron-core, TE, flash-attn), then per phase the exact command
# of each step with its result. Exit code: 0 when every step passed or was skipped with a stated
# reason, 1 otherwise, 2 for bad usage (an unknown phase or round: one line naming the valid ones).
#
# Environment:
#   OUT          where the logs go (default runs/gpu_validate): PHASE.log per phase (ROUND-PHASE.log
#                in a round) and summary.md (this call's block of $DOCS). On the device machine OUT
#                is set, and at most 8 files come back: run at most 7 phases per call (a round
#                writes one log per phase it touches, 6 at most, and summary.md).
#   DOCS         the Markdown file the block is appended to (default docs/benchmarks.md). The device
#                machine's working tree does not come back: append $OUT/summary.md to it here.
#   MEGATRON_LM  Megatron-LM at tag core_v0.16.1, for pretrain-gpt (default ../shared/megatron-lm
#                where it holds pretrain_gpt.py, as the tests look for it, else .whl/megatron-lm,
#                the copy scripts/gpu/prepare_carry.sh puts in the carried folder)
#   PYTHON       the interpreter (default python3)
#
# Setup, before the first phase (about 40 s at most, counted in each round's 8 minutes): the project
# is used from the working tree (PYTHONPATH=$PWD, python3 -m megatron_pp_ext ...), never
# pip-installed. When megatron-core does not import, the wheels brought along in .whl/
# (git-ignored) are installed, and nothing otherwise:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# The GPU machine: Python 3.12 on x86-64 with torch 2.11 (CUDA 13) and its triton, numpy, pytest,
# matplotlib, tqdm and pyyaml; no megatron-core, Transformer Engine, flash-attn or apex; no
# internet. scripts/gpu/prepare_carry.sh, run on a machine with pip access, fills .whl/ with what
# the rounds need (megatron-core 0.16.1, packaging, pydantic and its pins, six, regex, hypothesis
# with sortedcontainers, and a trimmed copy of Megatron-LM in .whl/megatron-lm), checks one version
# per package and the 64 MiB a device call carries, and prints the folder to carry.
#
# setup.py's install_requires (matplotlib, tqdm, pyyaml) are on the GPU machine already; its
# "gpu" extra (transformer-engine, flash-attn) is optional: without it the local layer spec, torch's
# SDPA and torch's optimizers are used, and the phases say which ran.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-runs/gpu_validate}
DOCS=${DOCS:-docs/benchmarks.md}
if [[ -z ${MEGATRON_LM:-} ]]; then  # the tests' checkout, else the carried copy
    MEGATRON_LM=$REPO/../shared/megatron-lm
    [[ -f $MEGATRON_LM/pretrain_gpt.py ]] || MEGATRON_LM=$REPO/.whl/megatron-lm
fi
G=scripts/gpu
PHASES=(preflight probe train-pp1 bw-split offload attention-memory post-validation shared-gpu pretrain-gpt
    cpu-suite sliced-attention bench bench-offload moe)
ROUNDS=(round-1 round-2 round-3 round-4 round-5)
ROUND_LIMIT_S=480  # one round: one command of at most 8 minutes on an H100
SETUP_S=40         # what setup may take in a round (pip install of .whl/, torch's and megatron's imports)

describe() {  # PHASE: sets CHECKS (what it checks), GPU, NEEDS (packages), TAKES (how long)
    GPU=yes NEEDS="torch, megatron-core"
    case $1 in
    preflight)
        CHECKS="each risky primitive once (scripts/gpu/preflight.py): gloo all_reduce (plain and coalesced, as"
        CHECKS+=" Megatron's DDP) and isend/irecv of CUDA tensors staged through pinned host memory, 2 ranks on"
        CHECKS+=" the GPU; a bf16 matmul; SDPA's flash kernel forward + backward; CUDA events; a side"
        CHECKS+=" torch.cuda.Stream; non-blocking pinned-memory copies"
        NEEDS=torch TAKES="~0.5 min" ;;
    probe)
        CHECKS="versions; which of megatron.core, transformer_engine, flash_attn, apex import; GPU name and"
        CHECKS+=" memory; torch.cuda.is_available(); bf16; NCCL version and a one-rank NCCL all-reduce"
        GPU="no (its GPU checks SKIP without one)" TAKES="~1 min" ;;
    train-pp1)
        CHECKS="megatron-pp-ext train at pipeline size 1 in bf16, 5 iterations each, losses printed: 1f1b, zb-h1"
        CHECKS+=" (local spec, and TE's spec where TE imports), seq1f1b with 4 slices, 1f1b and interleaved-1f1b"
        CHECKS+=" with --pp-offload full"
        TAKES="~4 min" ;;
    bw-split)
        CHECKS="one chunk's backward split into B (input gradient) and W (weight gradients) against the unsplit"
        CHECKS+=" backward on CUDA, first/middle/last stage, gradients within one bf16 epsilon; on the local spec"
        CHECKS+=" and on Transformer Engine's (TE's own deferred weight gradient, TE >= 2.3; SKIP without)"
        TAKES="~1 min" ;;
    offload)
        CHECKS="activation offload (copy streams, pinned host pool) under TORCH_CUDA_SANITIZER=1: gradients and"
        CHECKS+=" losses bitwise equal to no offload"
        TAKES="~3 min" ;;
    attention-memory)
        CHECKS="peak GPU memory of one Llama-3-8B attention (s=8192, 32 heads, 8 KV heads, bf16): Megatron's"
        CHECKS+=" local DotProductAttention against PyTorch SDPA"
        TAKES="~1 min" ;;
    post-validation)
        CHECKS="200 bf16 training steps with --pp-post-validation against the plain optimizer, loss by loss"
        CHECKS+=" (identical, or within 5 %)"
        TAKES="~4 min" ;;
    shared-gpu)
        CHECKS="every schedule at pipeline size 2-4 with the ranks sharing the GPU, against pipeline size 1 in"
        CHECKS+=" bf16 (train --distributed-backend gloo: messages staged through host memory)"
        TAKES="~9 min" ;;
    pretrain-gpt)
        CHECKS="Megatron-LM's pretrain_gpt.py patched from patches/ (--mock-data, world size 1, bf16, local"
        CHECKS+=" spec): zb-h1, seq1f1b with 2 slices, 4 iterations each"
        NEEDS+=", Megatron-LM core_v0.16.1 at \$MEGATRON_LM, six, regex, pydantic, triton" TAKES="~4 min" ;;
    cpu-suite)
        CHECKS="the quick CPU test subset (pytest -m \"not slow and not heavy\") with CUDA_VISIBLE_DEVICES= on"
        CHECKS+=" this machine's torch"
        GPU=no NEEDS+=", pytest, hypothesis" TAKES="~5-9 min" ;;
    sliced-attention)
        CHECKS="sliced (4 slices) against unsliced causal attention, forward + backward time at 16K, 32K, 64K"
        CHECKS+=" and 128K tokens, bf16, GQA 8:1, torch_flash and sdpa (and flash_attn when present)"
        NEEDS=torch TAKES="~3 min" ;;
    bench)
        CHECKS="bench --against megatron at pipeline size 2 (a GPU per rank, or the ranks sharing one), the"
        CHECKS+=" medium bench model: every schedule of ours against Megatron's own, the same first step"
        TAKES="~5-9 min" ;;
    bench-offload)
        CHECKS="the same bench with our offload (full, selective, auto) against Megatron's fine-grained"
        CHECKS+=" activation offloading of attention and norm inputs (only with Transformer Engine)"
        NEEDS+=", Transformer Engine for Megatron's side" TAKES="~5-9 min" ;;
    moe)
        CHECKS="the MoE model (4 experts, top-2 routing, EP 2) at PP 2 x DP 2 with the 4 ranks sharing the GPU"
        CHECKS+=" (train --distributed-backend gloo), bf16, 3 iterations each: dualpipev, zb-h1; finite losses;"
        CHECKS+=" then dualpipev and v-zb with --overlap-moe-expert-parallel-comm (alltoall dispatcher: each"
        CHECKS+=" F&B pair through megatron-core's schedule plan, the all-to-alls on its communication stream)"
        TAKES="~4-7 min" ;;
    esac
}

usage() { sed -n '2,18s/^# \{0,1\}//p' "$0"; }

round_parts() {  # ROUND: sets PARTS (PHASE/STEP:SECONDS, in the order run) and ABOUT
    case $1 in
    round-1)
        ABOUT="first contact: preflight, probe, train at PP 1, B/W split, attention memory, a PP 2 canary"
        PARTS=(preflight/primitives:30 probe/imports:40 probe/cuda:20 probe/nccl:30
            train-pp1/1f1b:45 train-pp1/zb-h1:45 train-pp1/seq1f1b-k4:45 train-pp1/interleaved-offload:45
            bw-split/b-then-w:40 attention-memory/llama3-8b-s8192:40 shared-gpu/canary-pp2:60) ;;
    round-2)
        ABOUT="every schedule family at PP 2-4 on the one GPU against PP 1 (families first, then variants),"
        ABOUT+=" sliced attention against one unsliced flash call at 16K-128K"
        PARTS=(shared-gpu/families-first:300 sliced-attention/flash-16k:25 sliced-attention/flash-32k:30
            sliced-attention/flash-64k:35 sliced-attention/flash-128k:50) ;;
    round-3)
        ABOUT="Megatron-LM's patched pretrain_gpt.py (world 1, NCCL, bf16, mock data), offload under the"
        ABOUT+=" CUDA sanitizer"
        PARTS=(pretrain-gpt/zb-h1:120 pretrain-gpt/seq1f1b-k2:120 offload/sanitizer:200) ;;
    round-4)
        ABOUT="bench --against megatron at PP 2 (medium model, 9 schedules), post-validation over 200 bf16 steps"
        PARTS=(bench/against-megatron:240 post-validation/200-steps:200) ;;
    round-5)
        ABOUT="the MoE model and the paired schedules on the shared GPU (EP 2, PP 2, DP 2, gloo)"
        PARTS=(moe/dualpipev:100 moe/zb-h1:100 moe/dualpipev-paired:120 moe/v-zb-paired:120) ;;
    *) return 1 ;;
    esac
}

dry_run() {
    local phase item part CHECKS GPU NEEDS TAKES PARTS ABOUT total files status=0
    printf '%-17s %s\n' "phase" "what it checks | GPU | needs | how long (setup first: see the header)"
    for phase in "${PHASES[@]}"; do
        describe "$phase"
        printf '%-17s %s | GPU: %s | needs: %s | %s\n' "$phase" "$CHECKS" "$GPU" "$NEEDS" "$TAKES"
    done
    # the steps each phase defines, with their commands (the phase functions run in COLLECT mode)
    declare -gA STEP_COMMAND=()
    COLLECT=1 NO_GPU=""
    for phase in "${PHASES[@]}"; do
        PHASE=$phase
        "phase_${phase//-/_}"
    done
    COLLECT=""
    echo
    echo "rounds: scripts/gpu_validate.sh ROUND, one command of at most $((ROUND_LIMIT_S / 60)) min each: setup" \
        "(at most $SETUP_S s), then each PHASE/STEP in order, within its time limit"
    for item in "${ROUNDS[@]}"; do
        round_parts "$item"
        total=$SETUP_S
        declare -A touched=()
        for part in "${PARTS[@]}"; do
            total=$((total + ${part##*:}))
            touched[${part%%/*}]=1
        done
        files=$((${#touched[@]} + 1))
        unset touched
        printf '%-8s at most %d s = %s min (setup %d s + steps %d s), %d files back: %s\n' "$item" "$total" \
            "$(awk -v s="$total" 'BEGIN { printf "%.1f", s / 60 }')" "$SETUP_S" "$((total - SETUP_S))" "$files" "$ABOUT"
        for part in "${PARTS[@]}"; do
            if [[ -n ${STEP_COMMAND[${part%:*}]+set} ]]; then
                printf '  %-36s %4d s  %s\n' "${part%:*}" "${part##*:}" "${STEP_COMMAND[${part%:*}]}"
            else
                printf '  %-36s %4d s  NO SUCH STEP\n' "${part%:*}" "${part##*:}"
                status=1
            fi
        done
        if ((total > ROUND_LIMIT_S || files > 8)); then
            echo "  OVER: a round must fit $ROUND_LIMIT_S s and 8 files back"
            status=1
        fi
    done
    return "$status"
}

# ---- arguments ---------------------------------------------------------------------------------

(($# > 0)) || { usage >&2; exit 2; }
SELECTED=()
DRY=0
for arg in "$@"; do
    case $arg in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY=1 ;;
    all) SELECTED+=("${PHASES[@]}") ;;
    *)
        if [[ " ${PHASES[*]} ${ROUNDS[*]} " != *" $arg "* ]]; then
            echo "gpu_validate.sh: unknown phase or round '$arg'; valid rounds: ${ROUNDS[*]}; valid phases:" \
                "${PHASES[*]}, all (or --dry-run)" >&2
            exit 2
        fi
        SELECTED+=("$arg")
        ;;
    esac
done

# ---- setup: wheels, PYTHONPATH, what the machine is --------------------------------------------

setup() {
    local base="$PWD${PYTHONPATH:+:$PYTHONPATH}" started=$SECONDS
    export PYTHONPATH=$base
    if "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
        SETUP_NOTE="megatron-core imports: nothing installed"
    elif PYTHONPATH=/tmp/site:$base "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
        export PYTHONPATH=/tmp/site:$base
        SETUP_NOTE="megatron-core imports from /tmp/site (installed by an earlier call)"
    elif compgen -G ".whl/*.whl" >/dev/null; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
            export PYTHONPATH=/tmp/site:$base
            SETUP_NOTE="installed $(compgen -G '.whl/*.whl' | xargs -n1 basename | paste -sd' ') into /tmp/site"
        else
            SETUP_NOTE="pip install of .whl/*.whl into /tmp/site FAILED"
        fi
    else
        SETUP_NOTE="megatron-core does not import and .whl/ has no wheels (see the header: how to fetch them)"
    fi
    echo "setup: $SETUP_NOTE (PYTHONPATH=$PYTHONPATH)"

    NO_GPU=""
    local answer
    if ! answer=$("$PY" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null); then
        NO_GPU="torch does not import"
    elif [[ $(tail -n 1 <<<"$answer") != True ]]; then
        NO_GPU="no CUDA device (torch.cuda.is_available() is False)"
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        DEVICE=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | paste -sd';')
        DEVICE_NAME=${DEVICE%%,*}
    else
        DEVICE="no GPU (nvidia-smi not found)"
        DEVICE_NAME="no GPU"
    fi
    VERSIONS=$("$PY" "$G/probe.py" versions --line 2>/dev/null | tail -n 1)
    VERSIONS=${VERSIONS:-"unknown ($PY $G/probe.py versions failed)"}
    DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
    echo "device: $DEVICE"
    echo "versions: $VERSIONS"
    SETUP_TOOK=$((SECONDS - started))
    SETUP_NOTE+="; setup took $SETUP_TOOK s"
}

# ---- steps and results -------------------------------------------------------------------------

FAILED=0
RESULTS=()
HEADER_WRITTEN=0

quote() {  # the command as one shell line
    local arg out=()
    for arg in "$@"; do
        if [[ -z $arg || $arg =~ [^A-Za-z0-9_./:=,+@%-] ]]; then
            out+=("'${arg//\'/\'\\\'\'}'")
        else
            out+=("$arg")
        fi
    done
    echo "${out[*]}"
}

last_marked() {  # FILE PREFIX: the text of the last "PREFIX: ..." line
    tr '\r' '\n' <"$1" | grep -a "^$2: " | tail -n 1 | cut -c "$((${#2} + 3))-400"
}

last_line() {  # FILE: the last non-empty line
    tr '\r' '\n' <"$1" | grep -av '^[[:space:]]*$' | tail -n 1 | cut -c 1-300
}

record() {  # STATUS STEP SECONDS REASON COMMAND
    local line="$1 $PHASE/$2 ($3 s)${4:+: $4}"
    echo "$line" | tee -a "$LOG"
    RESULTS+=("$line")
    [[ $1 != FAIL ]] || FAILED=1
    PHASE_LINES+=("- $1 \`$PHASE/$2\` ($3 s)${4:+: $4}" "  \`$5\`")
}

COLLECT=""     # --dry-run: the phase functions only name their steps (STEP_COMMAND)
ONLY=""        # in a round: the one step of $PHASE to run; the phase passes the others over
ONLY_LIMIT=""  # ... and its time limit, from the round's table
KILL_AFTER=20  # seconds between a step's timeout (SIGTERM) and SIGKILL; 5 in a round

selected() {  # NAME LIMIT COMMAND...: whether the step runs now (sets LIMIT); LIMIT "-": a round's only
    if [[ -n $COLLECT ]]; then
        STEP_COMMAND[$PHASE/$1]=$(quote "${@:3}")
        return 1
    fi
    if [[ -n $ONLY ]]; then
        [[ $1 == "$ONLY" ]] || return 1
        LIMIT=$ONLY_LIMIT RAN=1
    else
        [[ $2 != - ]] || return 1
        LIMIT=$2
    fi
}

step() {  # NAME LIMIT COMMAND...: run COMMAND into the phase's log, record its result
    local LIMIT
    selected "$@" || return 0
    run_step "$1" "$LIMIT" "${@:3}"
}

run_step() {  # NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    local shown tmp rc status reason start=$SECONDS
    shown=$(quote "$@")
    tmp=$(mktemp)
    printf '\n=== %s/%s: %s\n' "$PHASE" "$name" "$shown" | tee -a "$LOG"
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" </dev/null 2>&1 | tee -a "$LOG" "$tmp"
    rc=${PIPESTATUS[0]}
    case $rc in
    0) status=PASS reason=$(last_marked "$tmp" PASS) ;;
    77)
        status=SKIP reason=$(last_marked "$tmp" SKIP)
        [[ -n $reason ]] || status=FAIL reason="exit 77 without a SKIP: line"
        ;;
    124 | 137) status=FAIL reason="timed out after $limit s" ;;
    *)
        status=FAIL reason=$(last_marked "$tmp" FAIL)
        reason=${reason:-"exit $rc: $(last_line "$tmp")"}
        ;;
    esac
    rm -f "$tmp"
    record "$status" "$name" "$((SECONDS - start))" "$reason" "$shown"
}

skip_step() {  # NAME LIMIT REASON COMMAND...: record a SKIP for a step that cannot run here
    local LIMIT name=$1 reason=$3
    selected "$1" "$2" "${@:4}" || return 0
    printf '\n=== %s/%s: %s\n' "$PHASE" "$name" "$(quote "${@:4}")" >>"$LOG"
    record SKIP "$name" 0 "$reason" "$(quote "${@:4}")"
}

gpu_step() {  # NAME LIMIT COMMAND...: a step that needs the GPU (SKIP without one)
    local LIMIT
    selected "$@" || return 0
    if [[ -n $NO_GPU ]]; then
        printf '\n=== %s/%s: %s\n' "$PHASE" "$1" "$(quote "${@:3}")" >>"$LOG"
        record SKIP "$1" 0 "$NO_GPU" "$(quote "${@:3}")"
    else
        run_step "$1" "$LIMIT" "${@:3}"
    fi
}

write_docs() {  # this phase's block (after the call's heading, once) to $DOCS and summary.md
    if ((!HEADER_WRITTEN)); then
        HEADER_WRITTEN=1
        mkdir -p "$(dirname "$DOCS")"
        {
            echo
            echo "## GPU validation, $DATE ($DEVICE_NAME)"
            echo
            echo "- date: $DATE"
            echo "- device (nvidia-smi name, memory, driver): $DEVICE"
            echo "- versions: $VERSIONS"
            echo "- setup: $SETUP_NOTE; every command below runs from the repository root with PYTHONPATH=$PYTHONPATH"
            echo "- command: \`scripts/gpu_validate.sh ${ARGS[*]}\`; logs in \`$OUT_DIR/\` (PHASE.log, ROUND-PHASE.log in a round)"
        } | tee -a "$DOCS" >>"$SUMMARY"
    fi
    local heading=$PHASE
    [[ -z $ROUND ]] || heading="$ROUND: $PHASE"
    { echo; echo "### $heading"; echo; printf '%s\n' "${PHASE_LINES[@]}"; } | tee -a "$DOCS" >>"$SUMMARY"
}

# ---- the phases --------------------------------------------------------------------------------
# step NAME LIMIT COMMAND...: LIMIT is the phase's own time limit in seconds; "-" marks a step only
# rounds run (the round's table gives its limit); in a round every step takes the table's limit.

phase_preflight() { gpu_step primitives 60 "$PY" "$G/preflight.py"; }

phase_probe() {
    step versions 120 "$PY" "$G/probe.py" versions
    step imports 300 "$PY" "$G/probe.py" imports
    if command -v nvidia-smi >/dev/null 2>&1; then
        step nvidia-smi 60 nvidia-smi
    else
        skip_step nvidia-smi 60 "nvidia-smi not found" nvidia-smi
    fi
    step cuda 120 "$PY" "$G/probe.py" cuda
    step bf16 120 "$PY" "$G/probe.py" bf16
    step nccl 180 "$PY" "$G/probe.py" nccl
}

phase_train_pp1() {  # about 30 s a run; 6 x 95 s at most
    gpu_step 1f1b 95 "$PY" "$G/train_step.py" -- --pp-schedule 1f1b
    gpu_step zb-h1 95 "$PY" "$G/train_step.py" -- --pp-schedule zb-h1 --transformer-impl local
    # the B/W split on TE's spec: W through TE's own deferred weight gradient (SKIP without TE)
    gpu_step zb-h1-te 95 "$PY" "$G/train_step.py" -- --pp-schedule zb-h1 --transformer-impl transformer_engine
    gpu_step seq1f1b-k4 95 "$PY" "$G/train_step.py" -- --pp-schedule seq1f1b --pp-seq-slices 4
    gpu_step 1f1b-offload 95 "$PY" "$G/train_step.py" -- --pp-schedule 1f1b --pp-offload full
    # at pipeline size 1, 1F1B runs each backward right after its forward, so full offload picks no
    # unit; interleaved 1F1B (2 chunks) keeps chunk 0's units across chunk 1's ops and offloads them
    gpu_step interleaved-offload 95 "$PY" "$G/train_step.py" -- --pp-schedule interleaved-1f1b --pp-offload full
}

phase_bw_split() {
    gpu_step b-then-w 240 "$PY" "$G/bw_split.py"
    gpu_step b-then-w-te 240 "$PY" "$G/bw_split.py" --spec te
}

phase_offload() { gpu_step sanitizer 540 env TORCH_CUDA_SANITIZER=1 "$PY" "$G/offload.py"; }

phase_attention_memory() { gpu_step llama3-8b-s8192 300 "$PY" "$G/attention_memory.py"; }

phase_post_validation() { gpu_step 200-steps 560 "$PY" "$G/post_validation.py" --iterations 200; }

phase_shared_gpu() {  # the steps SKIP themselves until train has --distributed-backend
    step pp2-4 570 "$PY" "$G/shared_gpu.py"
    # round-1's canary: the PP 1 reference and 1F1B at PP 2, the ranks sharing the GPU
    step canary-pp2 - "$PY" "$G/shared_gpu.py" --runs 1f1b@2 --budget 30
    # round-2: one run of each family, then the variants until 250 s have gone (each run ~30 s)
    step families-first - "$PY" "$G/shared_gpu.py" --runs families,rest --budget 250
}

phase_pretrain_gpt() {
    gpu_step zb-h1 280 "$PY" "$G/megatron_lm_run.py" "$MEGATRON_LM" -- --pp-schedule zb-h1
    gpu_step seq1f1b-k2 280 "$PY" "$G/megatron_lm_run.py" "$MEGATRON_LM" -- --pp-schedule seq1f1b --pp-seq-slices 2
}

phase_cpu_suite() {
    # -o addopts: no pytest-xdist workers (the wheels carried there need not include it)
    local command=(env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -x -p no:cacheprovider -o addopts=-ra -m "not slow and not heavy")
    if [[ -n $COLLECT ]] || "$PY" -c 'import hypothesis' >/dev/null 2>&1; then  # (--dry-run imports nothing)
        step quick-subset 570 "${command[@]}"
    else
        skip_step quick-subset 570 "hypothesis does not import (the tests' dev extra: bring its wheel, see the header)" \
            "${command[@]}"
    fi
}

phase_sliced_attention() {
    gpu_step s16k 90 "$PY" "$G/sliced_attention.py" 16384
    gpu_step s32k 100 "$PY" "$G/sliced_attention.py" 32768
    gpu_step s64k 150 "$PY" "$G/sliced_attention.py" 65536
    gpu_step s128k 240 "$PY" "$G/sliced_attention.py" 131072
    # round-2: against one unsliced flash call only (torch's flash kernel, flash_attn where it imports)
    local flash=(--backends torch_flash,flash_attn --repeats 2)
    gpu_step flash-16k - "$PY" "$G/sliced_attention.py" 16384 "${flash[@]}"
    gpu_step flash-32k - "$PY" "$G/sliced_attention.py" 32768 "${flash[@]}"
    gpu_step flash-64k - "$PY" "$G/sliced_attention.py" 65536 "${flash[@]}"
    gpu_step flash-128k - "$PY" "$G/sliced_attention.py" 131072 "${flash[@]}"
}

phase_bench() { gpu_step against-megatron 570 "$PY" "$G/bench_megatron.py" schedules; }

phase_bench_offload() { gpu_step offload-vs-megatron 570 "$PY" "$G/bench_megatron.py" offload; }

phase_moe() {  # 4 ranks (PP 2 x DP 2) on the one GPU: gloo, messages staged through host memory
    local moe=(--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --pp 2 --data-parallel-size 2
        --distributed-backend gloo)
    gpu_step dualpipev 280 "$PY" "$G/train_step.py" --iterations 3 -- "${moe[@]}" --pp-schedule dualpipev
    gpu_step zb-h1 280 "$PY" "$G/train_step.py" --iterations 3 -- "${moe[@]}" --pp-schedule zb-h1
    local paired=(--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm)
    gpu_step dualpipev-paired 280 "$PY" "$G/train_step.py" --iterations 3 -- "${moe[@]}" "${paired[@]}" \
        --pp-schedule dualpipev
    gpu_step v-zb-paired 280 "$PY" "$G/train_step.py" --iterations 3 -- "${moe[@]}" "${paired[@]}" \
        --pp-schedule v-zb
}

# ---- main --------------------------------------------------------------------------------------

if ((DRY)); then
    dry_run
    exit $?
fi

ROUND=""
declare -A LOG_STARTED=()

start_phase() {  # PHASE is set: its log (started once per call), its lines for the docs
    LOG=$OUT_DIR/${ROUND:+$ROUND-}$PHASE.log
    PHASE_LINES=()
    if [[ -z ${LOG_STARTED[$LOG]+set} ]]; then
        LOG_STARTED[$LOG]=1
        {
            echo "# gpu_validate.sh ${ROUND:+$ROUND: }$PHASE, $DATE"
            echo "# setup: $SETUP_NOTE"
            echo "# device: $DEVICE"
            echo "# versions: $VERSIONS"
        } >"$LOG"
    fi
    echo
    echo "##### ${ROUND:+$ROUND: }phase $PHASE (log: $LOG)"
}

run_phase() {  # PHASE: every step it runs on its own
    PHASE=$1 ROUND="" ONLY="" KILL_AFTER=20
    start_phase
    "phase_${PHASE//-/_}"
    write_docs
}

run_round() {  # ROUND: its parts in order, consecutive parts of one phase in one docs block
    local PARTS ABOUT part rest current="" started=$SECONDS RAN
    ROUND=$1 KILL_AFTER=5
    round_parts "$ROUND"
    echo
    echo "##### $ROUND: $ABOUT"
    for part in "${PARTS[@]}"; do
        rest=${part#*/}
        PHASE=${part%%/*} ONLY=${rest%%:*} ONLY_LIMIT=${part##*:} RAN=0
        if [[ $PHASE != "$current" ]]; then
            [[ -z $current ]] || { local next=$PHASE; PHASE=$current; write_docs; PHASE=$next; }
            current=$PHASE
            start_phase
        fi
        "phase_${PHASE//-/_}"
        ((RAN)) || record FAIL "$ONLY" 0 "the round names a step its phase does not have" "phase_${PHASE//-/_}"
    done
    [[ -z $current ]] || write_docs
    local took="$ROUND: its steps took $((SECONDS - started)) s after setup's $SETUP_TOOK s (the round's limit:"
    took+=" $ROUND_LIMIT_S s in all)"
    RESULTS+=("$took")
    { echo; echo "- $took"; } | tee -a "$DOCS" >>"$SUMMARY"
    ROUND="" ONLY=""
}

ARGS=("$@")
mkdir -p "$OUT_DIR"
SUMMARY=$OUT_DIR/summary.md
: >"$SUMMARY"
setup
for item in "${SELECTED[@]}"; do
    if [[ " ${ROUNDS[*]} " == *" $item "* ]]; then
        run_round "$item"
    else
        run_phase "$item"
    fi
done

echo
echo "##### results (setup took $SETUP_TOOK s)"
printf '%s\n' "${RESULTS[@]}"
passed=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^PASS')
skipped=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^SKIP')
failed=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^FAIL')
echo "gpu_validate.sh: $passed passed, $skipped skipped, $failed failed; block appended to $DOCS and $SUMMARY"
exit "$FAILED"
