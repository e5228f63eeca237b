# GPU image: NVIDIA's PyTorch container (CUDA, NCCL, Transformer Engine, flash-attn, triton) with
# Megatron-LM at the tag matching the pinned megatron-core, patched to run megatron_pp_ext's pipeline
# schedules from pretrain_gpt.py, and the plugin installed: all by scripts/setup_megatron_lm.sh, the
# same script a cluster without containers runs (and the tests check).
#
# Build:  docker build -t megatron-pp-ext .
# Run:    docker run --gpus all --ipc=host -it megatron-pp-ext megatron-pp-ext train --pp-schedule zb-h1
# SLURM:  enroot import -o megatron-pp-ext.sqsh dockerd://megatron-pp-ext
#         sbatch scripts/slurm/llama2-70b-slimpipe-128k.sbatch        (pyxis: CONTAINER_IMAGE=megatron-pp-ext.sqsh)
# The NGC release Megatron-LM core_v0.16.1 builds its own images on (its docker/.ngc_version.dev):
# the PyTorch, Transformer Engine and CUDA that megatron-core 0.16.1 is developed against.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

# NGC pins its Python environment through PIP_CONSTRAINT; megatron-core and Megatron-LM's training
# packages are installed from source on top, so the constraint is lifted as Megatron-LM's own
# images do (docker/Dockerfile.ci.dev)
ENV PIP_NO_CACHE_DIR=1 \
    PIP_CONSTRAINT="" \
    MEGATRON_LM=/opt/Megatron-LM
WORKDIR /opt/megatron_pp_ext
COPY setup.py pyproject.toml README.md ./
COPY megatron_pp_ext ./megatron_pp_ext
COPY configs ./configs
COPY scripts ./scripts
COPY patches ./patches
COPY tests ./tests
# Megatron-LM core_v0.16.1 cloned to /opt/Megatron-LM and patched; megatron-core installed from that
# tree (--no-deps: the container's torch stays); the plugin (editable, with its test tools);
# Megatron-LM's training dependencies.
RUN PLUGIN_EXTRAS=dev MEGATRON_PP_EXT=/opt/megatron_pp_ext \
    bash scripts/setup_megatron_lm.sh /opt/Megatron-LM
# Transformer Engine comes with the NGC image; the build stops unless it is in the range setup.py's
# "gpu" extra allows: from 2.3 (TE's deferred weight gradient, the W op of B/W-split schedules on
# TE's spec) and below 2.12 (megatron-core 0.16.1's own bound: Megatron-LM core_v0.16.1's
# pyproject.toml, dev extra, "transformer-engine[pytorch,core_cu13]>=2.9.0a0,<2.12.0").
ARG TE_RANGE=">=2.3,<2.12"
RUN python3 -c "import sys, importlib.metadata as m; from packaging.specifiers import SpecifierSet; \
names = {(d.metadata['Name'] or '').lower().replace('_', '-'): d.version for d in m.distributions()}; \
have = names.get('transformer-engine'); \
ok = have is not None and SpecifierSet(sys.argv[1]).contains(have, prereleases=True); \
print(f'Transformer Engine {have or \"not installed\"}', 'is in' if ok else 'is NOT in', sys.argv[1]); \
sys.exit(0 if ok else 1)" "$TE_RANGE"

WORKDIR /opt/Megatron-LM
CMD ["megatron-pp-ext", "--help"]
