# GPU image: NVIDIA's PyTorch container brings CUDA, NCCL, Transformer Engine and flash-attn.
# Build:  docker build -t megatron-pp-ext .
# Run:    docker run --gpus all --ipc=host -it megatron-pp-ext megatron-pp-ext train --pp-schedule zb-h1
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /opt/megatron_pp_ext
COPY setup.py pyproject.toml README.md ./
COPY megatron_pp_ext ./megatron_pp_ext
COPY configs ./configs
COPY scripts ./scripts
COPY patches ./patches
COPY tests ./tests
# The container already has torch; install megatron-core and our package without touching it.
RUN pip install --no-cache-dir "megatron-core>=0.16,<0.17" && pip install --no-cache-dir -e ".[dev]"

CMD ["megatron-pp-ext", "--help"]
