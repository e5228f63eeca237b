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

WORKDIR /opt/Megatron-LM
CMD ["megatron-pp-ext", "--help"]
