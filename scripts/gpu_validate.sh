#!/usr/bin/env bash
# gpu_validate.sh: validate a GPU machine for megatron_pp_ext, phase by phase, each phase short
# enough for one 10-minute call.
#
#   scripts/gpu_validate.sh PHASE [PHASE...]   run these phases in the order given
#   scripts/gpu_validate.sh all                every phase (more than one 10-minute call's worth)
#   scripts/gpu_validate.sh --dry-run          list the phases (what each checks, whether it needs
#                                              a GPU, which packages, roughly how long); runs
#                                              nothing, needs neither a GPU nor torch
#   scripts/gpu_validate.sh --help
#
# A phase runs a few steps; a step is one command (most are the short scripts in scripts/gpu/,
# each says in its docstring what it checks and why) and ends PASS, FAIL or SKIP with its reason
# (SKIP: a prerequisite is missing, and the line names it). A failed step never stops the next.
# Each phase writes its output to $OUT/PHASE.log and appends a block to $DOCS: a heading
# "## GPU validation, <date> (<device>)" with the date (UTC), the device (nvidia-smi), the
# versions (python, torch, CUDA, megatron-core, TE, flash-attn), then per phase the exact command
# of each step with its result. Exit code: 0 when every step passed or was skipped with a stated
# reason, 1 otherwise, 2 for bad usage (an unknown phase: one line naming the valid ones).
#
# Environment:
#   OUT          where the logs go (default runs/gpu_validate): PHASE.log per phase and summary.md
#                (this call's block of $DOCS). On the device machine OUT is set, and at most 8 files
#                come back: run at most 7 phases per call.
#   DOCS         the Markdown file the block is appended to (default docs/benchmarks.md). The device
#                machine's working tree does not come back: append $OUT/summary.md to it here.
#   MEGATRON_LM  Megatron-LM at tag core_v0.16.1, for pretrain-gpt (default ../shared/megatron-lm,
#                where the tests look for it; a machine without it can be given a copy in a
#                git-ignored folder, e.g. .whl/megatron-lm, with MEGATRON_LM=.whl/megatron-lm)
#   PYTHON       the interpreter (default python3)
#
# Setup, before the first phase: the project is used from the working tree (PYTHONPATH=$PWD,
# python3 -m megatron_pp_ext ...), never pip-installed. When megatron-core does not import, the
# wheels brought along in .whl/ (git-ignored) are installed, and nothing otherwise:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# Fetching those wheels, on a machine with pip access, for the GPU machine (Python 3.12 on x86-64,
# with torch 2.11 cu130 and its triton, numpy, pytest, matplotlib, tqdm and pyyaml; no
# megatron-core, Transformer Engine, flash-attn or apex; no internet):
#
#   W="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl"
#   # the runtime: megatron-core (it needs torch, numpy, packaging>=24.2; the machine has torch and
#   # numpy, and packaging comes with pytest and matplotlib but may be older than 24.2)
#   python3 -m pip download --no-deps $W megatron-core==0.16.1 packaging
#   # cpu-suite: the tests' dev extra beyond pytest (hypothesis, with its sortedcontainers);
#   # pretrain-gpt: what Megatron-LM's training package imports beyond megatron-core (six, regex,
#   # pydantic with pydantic-core, annotated-types, typing-inspection, typing-extensions; triton
#   # comes with torch). With their dependencies, so pydantic-core matches pydantic's pin:
#   python3 -m pip download $W hypothesis six regex pydantic
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
MEGATRON_LM=${MEGATRON_LM:-$REPO/../shared/megatron-lm}
G=scripts/gpu
PHASES=(probe train-pp1 bw-split offload attention-memory post-validation shared-gpu pretrain-gpt cpu-suite
    sliced-attention bench bench-offload)

describe() {  # PHASE: sets CHECKS (what it checks), GPU, NEEDS (packages), TAKES (how long)
    GPU=yes NEEDS="torch, megatron-core"
    case $1 in
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
    esac
}

usage() { sed -n '2,10s/^# \{0,1\}//p' "$0"; }

dry_run() {
    local phase CHECKS GPU NEEDS TAKES
    printf '%-17s %s\n' "phase" "what it checks | GPU | needs | how long (setup first: see the header)"
    for phase in "${PHASES[@]}"; do
        describe "$phase"
        printf '%-17s %s | GPU: %s | needs: %s | %s\n' "$phase" "$CHECKS" "$GPU" "$NEEDS" "$TAKES"
    done
}

# ---- arguments ---------------------------------------------------------------------------------

(($# > 0)) || { usage >&2; exit 2; }
SELECTED=()
for arg in "$@"; do
    case $arg in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run; exit 0 ;;
    all) SELECTED+=("${PHASES[@]}") ;;
    *)
        if [[ " ${PHASES[*]} " != *" $arg "* ]]; then
            echo "gpu_validate.sh: unknown phase '$arg'; valid phases: ${PHASES[*]}, all (or --dry-run)" >&2
            exit 2
        fi
        SELECTED+=("$arg")
        ;;
    esac
done

# ---- setup: wheels, PYTHONPATH, what the machine is --------------------------------------------

setup() {
    local base="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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

step() {  # NAME LIMIT_S COMMAND...: run COMMAND into the phase's log, record its result
    local name=$1 limit=$2
    shift 2
    local shown tmp rc status reason start=$SECONDS
    shown=$(quote "$@")
    tmp=$(mktemp)
    printf '\n=== %s/%s: %s\n' "$PHASE" "$name" "$shown" | tee -a "$LOG"
    timeout --kill-after=20 "$limit" "$@" </dev/null 2>&1 | tee -a "$LOG" "$tmp"
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

skip_step() {  # NAME REASON COMMAND...: record a SKIP for a step that cannot run here
    local name=$1 reason=$2
    shift 2
    printf '\n=== %s/%s: %s\n' "$PHASE" "$name" "$(quote "$@")" >>"$LOG"
    record SKIP "$name" 0 "$reason" "$(quote "$@")"
}

gpu_step() {  # NAME LIMIT_S COMMAND...: a step that needs the GPU (SKIP without one)
    if [[ -n $NO_GPU ]]; then
        skip_step "$1" "$NO_GPU" "${@:3}"
    else
        step "$@"
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
            echo "- command: \`scripts/gpu_validate.sh ${ARGS[*]}\`; logs in \`$OUT_DIR/PHASE.log\`"
        } | tee -a "$DOCS" >>"$SUMMARY"
    fi
    { echo; echo "### $PHASE"; echo; printf '%s\n' "${PHASE_LINES[@]}"; } | tee -a "$DOCS" >>"$SUMMARY"
}

# ---- the phases --------------------------------------------------------------------------------

phase_probe() {
    step versions 120 "$PY" "$G/probe.py" versions
    step imports 300 "$PY" "$G/probe.py" imports
    if command -v nvidia-smi >/dev/null 2>&1; then
        step nvidia-smi 60 nvidia-smi
    else
        skip_step nvidia-smi "nvidia-smi not found" nvidia-smi
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

phase_shared_gpu() { step pp2-4 570 "$PY" "$G/shared_gpu.py"; }  # SKIPs itself until the flag exists

phase_pretrain_gpt() {
    gpu_step zb-h1 280 "$PY" "$G/megatron_lm_run.py" "$MEGATRON_LM" -- --pp-schedule zb-h1
    gpu_step seq1f1b-k2 280 "$PY" "$G/megatron_lm_run.py" "$MEGATRON_LM" -- --pp-schedule seq1f1b --pp-seq-slices 2
}

phase_cpu_suite() {
    # -o addopts: no pytest-xdist workers (the wheels carried there need not include it)
    local command=(env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -x -p no:cacheprovider -o addopts=-ra -m "not slow and not heavy")
    if "$PY" -c 'import hypothesis' >/dev/null 2>&1; then
        step quick-subset 570 "${command[@]}"
    else
        skip_step quick-subset "hypothesis does not import (the tests' dev extra: bring its wheel, see the header)" \
            "${command[@]}"
    fi
}

phase_sliced_attention() {
    gpu_step s16k 90 "$PY" "$G/sliced_attention.py" 16384
    gpu_step s32k 100 "$PY" "$G/sliced_attention.py" 32768
    gpu_step s64k 150 "$PY" "$G/sliced_attention.py" 65536
    gpu_step s128k 240 "$PY" "$G/sliced_attention.py" 131072
}

phase_bench() { gpu_step against-megatron 570 "$PY" "$G/bench_megatron.py" schedules; }

phase_bench_offload() { gpu_step offload-vs-megatron 570 "$PY" "$G/bench_megatron.py" offload; }

# ---- main --------------------------------------------------------------------------------------

ARGS=("$@")
mkdir -p "$OUT_DIR"
SUMMARY=$OUT_DIR/summary.md
: >"$SUMMARY"
setup
for PHASE in "${SELECTED[@]}"; do
    LOG=$OUT_DIR/$PHASE.log
    PHASE_LINES=()
    {
        echo "# gpu_validate.sh $PHASE, $DATE"
        echo "# setup: $SETUP_NOTE"
        echo "# device: $DEVICE"
        echo "# versions: $VERSIONS"
    } >"$LOG"
    echo
    echo "##### phase $PHASE (log: $LOG)"
    "phase_${PHASE//-/_}"
    write_docs
done

echo
echo "##### results"
printf '%s\n' "${RESULTS[@]}"
passed=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^PASS')
skipped=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^SKIP')
failed=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^FAIL')
echo "gpu_validate.sh: $passed passed, $skipped skipped, $failed failed; block appended to $DOCS and $SUMMARY"
exit "$FAILED"
