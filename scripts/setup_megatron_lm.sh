#!/usr/bin/env bash
# Megatron-LM for megatron_pp_ext: the release matching the pinned megatron-core, patched so that
# pretrain_gpt.py runs the plugin's pipeline schedules, plus the plugin and Megatron-LM's training
# dependencies. The Dockerfile runs this; so can you, on a cluster without containers:
#
#   scripts/setup_megatron_lm.sh [DIR]
#
# DIR: an existing Megatron-LM checkout at tag $MEGATRON_LM_TAG to patch in place, or where to
# clone it (default: $MEGATRON_LM, else /opt/Megatron-LM). Then point scripts/slurm/launch.sh at it
# with MEGATRON_LM=DIR.
#
# Steps: 1. clone Megatron-LM at the tag (skipped when DIR holds a checkout; its version is checked);
# 2. apply patches/megatron-lm-<tag>.patch (skipped with a message when there is none; nothing to do
# when it is already applied); 3. pip install: megatron-core from that tree (so the plugin and
# pretrain_gpt.py import the same megatron.core; --no-deps keeps the installed torch), the plugin
# (pip install -e of this repository, or of $MEGATRON_PP_EXT, with extras $PLUGIN_EXTRAS), and
# Megatron-LM's training dependencies ($TRAINING_PACKAGES; triton comes with torch / the NGC image).
#
# Variables: MEGATRON_LM_TAG (default core_v0.16.1: megatron-core 0.16.1, the version setup.py pins),
# MEGATRON_LM_REPO (default https://github.com/NVIDIA/Megatron-LM.git), MEGATRON_PP_EXT (the plugin's
# source, default this repository), PLUGIN_EXTRAS (e.g. "dev"), TRAINING_PACKAGES, SETUP_PIP (the pip
# command, default "python3 -m pip"; "echo pip" shows the installs without running them).
set -euo pipefail

MEGATRON_LM_TAG=${MEGATRON_LM_TAG:-core_v0.16.1}
MEGATRON_LM_REPO=${MEGATRON_LM_REPO:-https://github.com/NVIDIA/Megatron-LM.git}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MEGATRON_PP_EXT=${MEGATRON_PP_EXT:-$HERE}
PLUGIN_EXTRAS=${PLUGIN_EXTRAS:-}
# six, regex, pydantic: imported by megatron.training; transformers, sentencepiece, tiktoken: the
# tokenizers of real data (HuggingFaceTokenizer and friends; mock data needs none of them).
TRAINING_PACKAGES=${TRAINING_PACKAGES:-six regex pydantic transformers sentencepiece tiktoken}
read -r -a PIP <<<"${SETUP_PIP:-python3 -m pip}"
DIR=${1:-${MEGATRON_LM:-/opt/Megatron-LM}}
PATCH=$MEGATRON_PP_EXT/patches/megatron-lm-${MEGATRON_LM_TAG}.patch

say() { echo "setup_megatron_lm: $*"; }
die() { echo "setup_megatron_lm: error: $*" >&2; exit 1; }

# 1. the checkout
if [[ -f "$DIR/pretrain_gpt.py" ]]; then
    say "using the Megatron-LM checkout in $DIR"
else
    [[ ! -e "$DIR" || -z "$(ls -A "$DIR")" ]] || die "$DIR exists but holds no Megatron-LM checkout"
    say "cloning $MEGATRON_LM_REPO at $MEGATRON_LM_TAG into $DIR"
    git clone --depth 1 --branch "$MEGATRON_LM_TAG" "$MEGATRON_LM_REPO" "$DIR"
fi
want=${MEGATRON_LM_TAG#core_v}
have=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) = \([0-9]*\).*/\2/p' "$DIR/megatron/core/package_info.py" | paste -sd.)
[[ "$have" == "$want" ]] ||
    die "$DIR is megatron-core $have, not $want ($MEGATRON_LM_TAG): check out that tag, or set MEGATRON_LM_TAG"

# 2. the patch (git apply works in a plain copy of the tree too)
if [[ ! -f "$PATCH" ]]; then
    say "no patch $PATCH yet: Megatron-LM left unpatched (pretrain_gpt.py will not run the plugin's schedules)"
elif (cd "$DIR" && git apply --reverse --check "$PATCH" 2>/dev/null); then
    say "patch $(basename "$PATCH") already applied in $DIR"
else
    (cd "$DIR" && git apply --check "$PATCH") || die "$(basename "$PATCH") does not apply to $DIR"
    (cd "$DIR" && git apply "$PATCH")
    say "patch $(basename "$PATCH") applied in $DIR"
fi

# 3. the installs
"${PIP[@]}" install --no-deps -e "$DIR"
"${PIP[@]}" install -e "$MEGATRON_PP_EXT${PLUGIN_EXTRAS:+[$PLUGIN_EXTRAS]}"
read -r -a packages <<<"$TRAINING_PACKAGES"
((${#packages[@]} == 0)) || "${PIP[@]}" install "${packages[@]}"
say "done: run pretrain_gpt.py from $DIR (scripts/slurm/launch.sh with MEGATRON_LM=$DIR)"
