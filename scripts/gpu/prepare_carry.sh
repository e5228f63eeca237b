#!/usr/bin/env bash
# prepare_carry.sh: fill the git-ignored .whl/ with exactly what scripts/gpu_validate.sh's rounds need
# on the GPU machine, and check that it can travel. Run it here, on a machine with pip access:
#
#   scripts/gpu/prepare_carry.sh
#
# The GPU machine: Python 3.12 on x86-64 with torch 2.11 (CUDA 13) and its triton, numpy, pytest,
# matplotlib, tqdm and pyyaml; no megatron-core, Transformer Engine, flash-attn or apex; no
# network; the working tree and the carried folder travel together, 64 MiB in all (../shared does
# not). What goes in:
#   - wheels for CPython 3.12, manylinux x86-64 (or pure Python), binary only, one version each:
#     megatron-core 0.16.1 (the runtime; it needs torch, numpy and packaging >= 24.2: packaging
#     comes too, the machine's may be older), six and regex (Megatron-LM's training package);
#     pydantic with the versions it pins (pydantic-core, annotated-types, typing-inspection,
#     typing-extensions: downloaded with their dependencies so pydantic-core matches); hypothesis
#     with sortedcontainers (the cpu-suite phase);
#   - megatron-lm/: what pretrain_gpt.py needs from Megatron-LM core_v0.16.1 beyond megatron-core
#     (pretrain_gpt.py, gpt_builders.py, model_provider.py, megatron/training, megatron/legacy,
#     megatron/rl's __init__ and parallel_utils, which megatron/training/training.py imports; no
#     .git, tests, docs, examples or images), plus megatron/core/package_info.py (the version) and
#     an empty megatron/core/datasets/ where scripts/gpu/megatron_lm_run.py copies the installed
#     megatron-core's built dataset helpers. megatron.core itself comes from the wheel (megatron is
#     a namespace package in both). gpu_validate.sh finds it there when ../shared/megatron-lm is
#     absent (MEGATRON_LM=.whl/megatron-lm).
# Wheels already in the folder stay (pip skips what it has); the megatron-lm/ copy is replaced.
#
# Checks, each failing in one line that names what is wrong: one version per package (a stale
# wheel beside a new one is named with both files), every package above present, every wheel for
# CPython 3.12 on x86-64, the Megatron-LM tree at 0.16.1, and the folder plus the working tree that
# travels with it (tracked files and untracked ones git does not ignore) within 64 MiB. Then it
# prints the folder to carry and the install line to use on the GPU machine (gpu_validate.sh runs
# that line itself when megatron.core does not import).
#
# Environment:
#   CARRY_DIR        the folder to fill (default .whl, relative to the repository root; must be
#                    git-ignored when inside the repository)
#   PIP_DOWNLOAD     the download command (default "python3 -m pip download"; the tests stub it)
#   MEGATRON_LM      the Megatron-LM checkout at core_v0.16.1 (default ../shared/megatron-lm)
#   CARRY_LIMIT_MIB  what a device call carries, the working tree included (default 64)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
CARRY=${CARRY_DIR:-.whl}
read -r -a PIP <<<"${PIP_DOWNLOAD:-python3 -m pip download}"
MEGATRON_LM=${MEGATRON_LM:-$REPO/../shared/megatron-lm}
LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
MEGATRON_CORE=0.16.1
# normalised names (PEP 503) of what the rounds need
REQUIRED=(megatron-core packaging six regex pydantic pydantic-core annotated-types typing-inspection
    typing-extensions hypothesis sortedcontainers)
# what pretrain_gpt.py needs from the Megatron-LM tree, beyond megatron-core (see the header)
MEGATRON_PARTS=(pretrain_gpt.py gpt_builders.py model_provider.py megatron/training megatron/legacy
    megatron/rl/__init__.py megatron/rl/parallel_utils.py megatron/core/package_info.py)

say() { echo "prepare_carry: $*"; }
die() { echo "prepare_carry: error: $*" >&2; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
norm() { tr 'A-Z_.' 'a-z--' <<<"$1" | tr -s '-'; }  # a distribution's name as PEP 503 compares it

mkdir -p "$CARRY"
CARRY_ABS=$(cd "$CARRY" && pwd)
INSIDE=""
case $CARRY_ABS/ in
"$REPO"/*)
    INSIDE=${CARRY_ABS#"$REPO"/}
    git check-ignore -q "$INSIDE/x.whl" ||
        die "$INSIDE is not git-ignored: add /$INSIDE/ to .gitignore (a device call carries it beside the tree)"
    ;;
*) say "note: $CARRY_ABS is outside the repository; a device call carries only folders inside it" ;;
esac

# ---- 1. the wheels ---------------------------------------------------------------------------------
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY_ABS")
say "downloading wheels for CPython 3.12 on x86-64 into $CARRY"
"${PIP[@]}" --no-deps "${TARGET[@]}" "megatron-core==$MEGATRON_CORE" "packaging>=24.2" six regex
"${PIP[@]}" "${TARGET[@]}" pydantic hypothesis  # with their dependencies: pydantic-core as pydantic pins it

declare -A FILES=() VERSION=()
BAD_TAGS=()
shopt -s nullglob
for wheel in "$CARRY_ABS"/*.whl; do
    base=${wheel##*/}
    IFS=- read -r -a fields <<<"${base%.whl}"
    ((${#fields[@]} >= 5)) || die "$base is not a wheel's file name (name-version-python-abi-platform.whl)"
    name=$(norm "${fields[0]}")
    FILES[$name]+="${FILES[$name]:+, }$base"
    VERSION[$name]=${fields[1]}
    python=${fields[-3]} abi=${fields[-2]} platform=${fields[-1]}
    ok=1
    [[ .$python. =~ \.(py3|cp312)\. ]] || ok=0
    [[ $abi == none || $abi == abi3 || $abi == cp312 ]] || ok=0
    IFS=. read -r -a platforms <<<"$platform"
    for tag in "${platforms[@]}"; do
        [[ $tag == any || ($tag == manylinux* && $tag == *_x86_64) ]] || ok=0
    done
    ((ok)) || BAD_TAGS+=("$base")
done
((${#BAD_TAGS[@]} == 0)) || die "not for CPython 3.12 on x86-64: ${BAD_TAGS[*]} (remove them from $CARRY)"
DUPLICATES=()
for name in "${!FILES[@]}"; do
    [[ ${FILES[$name]} != *", "* ]] || DUPLICATES+=("$name (${FILES[$name]})")
done
if ((${#DUPLICATES[@]})); then
    die "more than one version of: $(printf '%s; ' "${DUPLICATES[@]}" | sed 's/; $//') -- remove the stale ones from $CARRY and run again"
fi
MISSING=()
for name in "${REQUIRED[@]}"; do
    [[ -n ${FILES[$name]:-} ]] || MISSING+=("$name")
done
((${#MISSING[@]} == 0)) || die "no wheel in $CARRY for: ${MISSING[*]} (the download did not bring it)"
[[ ${VERSION[megatron-core]} == "$MEGATRON_CORE" ]] ||
    die "$CARRY has megatron-core ${VERSION[megatron-core]}, not $MEGATRON_CORE (${FILES[megatron-core]})"
mapfile -t NAMES < <(printf '%s\n' "${!FILES[@]}" | sort)
say "wheels, one version each: $(for n in "${NAMES[@]}"; do printf '%s %s, ' "$n" "${VERSION[$n]}"; done | sed 's/, $//')"

# ---- 2. the Megatron-LM copy -----------------------------------------------------------------------
[[ -f $MEGATRON_LM/pretrain_gpt.py ]] || die "no Megatron-LM checkout at $MEGATRON_LM (set MEGATRON_LM)"
have=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) = \([0-9]*\).*/\2/p' "$MEGATRON_LM/megatron/core/package_info.py" 2>/dev/null |
    paste -sd.)
[[ $have == "$MEGATRON_CORE" ]] ||
    die "$MEGATRON_LM is megatron-core ${have:-unknown}, not $MEGATRON_CORE: check out tag core_v$MEGATRON_CORE"
for part in "${MEGATRON_PARTS[@]}"; do
    [[ -e $MEGATRON_LM/$part ]] || die "$MEGATRON_LM has no $part"
done
COPY=$CARRY_ABS/megatron-lm
if [[ -e $COPY ]]; then
    [[ -f $COPY/.prepare_carry ]] || die "$COPY exists and was not made by this script: move it away"
    rm -rf -- "$COPY"
fi
mkdir -p "$COPY/megatron/core/datasets"
tar -C "$MEGATRON_LM" --exclude=.git --exclude=__pycache__ --exclude='*.pyc' --exclude=tests --exclude=docs \
    --exclude=examples --exclude=images -cf - "${MEGATRON_PARTS[@]}" | tar -C "$COPY" -xf -
[[ ! -f $MEGATRON_LM/LICENSE ]] || cp "$MEGATRON_LM/LICENSE" "$COPY/"
echo "megatron_lm_run.py copies the installed megatron-core's built dataset helpers here" \
    >"$COPY/megatron/core/datasets/README"
echo "made by scripts/gpu/prepare_carry.sh from $MEGATRON_LM (megatron-core $have)" >"$COPY/.prepare_carry"
say "Megatron-LM core_v$have: $(find "$COPY" -type f | wc -l) files, $(mib "$(du -sb "$COPY" | cut -f1)") in $CARRY/megatron-lm"

# ---- 3. the size -----------------------------------------------------------------------------------
carry_bytes=$(du -sb "$CARRY_ABS" | cut -f1)
tree_bytes=$( ( (git ls-files -z; git ls-files -z --others --exclude-standard) |
    xargs -0 -r stat -c %s 2>/dev/null || true) | awk '{ s += $1 } END { print s + 0 }')  # a deleted file: 0
total=$((carry_bytes + tree_bytes))
figure="$CARRY $(mib "$carry_bytes") + the working tree $(mib "$tree_bytes") = $(mib "$total")"
((total <= LIMIT_MIB * 1048576)) || die "$figure, over the $LIMIT_MIB MiB a device call carries"
say "size: $figure of $LIMIT_MIB MiB"

# ---- 4. what to do with it -------------------------------------------------------------------------
echo
say "carry: ${INSIDE:-$CARRY_ABS} (the device tool's carry=[\"${INSIDE:-$CARRY_ABS}\"]); each round is then one command:"
echo "  OUT=\$OUT scripts/gpu_validate.sh round-1        (round-2 .. round-5 alike; --dry-run lists them)"
say "install line on the GPU machine (gpu_validate.sh runs it itself when megatron.core does not import):"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site" \
    "${INSIDE:-$CARRY_ABS}/*.whl && export PYTHONPATH=/tmp/site:\$PWD MEGATRON_LM=\$PWD/${INSIDE:-$CARRY_ABS}/megatron-lm"
