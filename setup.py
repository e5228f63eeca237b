"""megatron_pp_ext: memory-thrifty, bubble-free pipeline schedules for Megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-pp-ext",
    version="0.1.0",
    description=(
        "Pipeline-parallel schedules (ZB, V-shape, DualPipeV, Seq1F1B, SlimPipe, offload) for Megatron-core"
    ),
    packages=find_packages(include=["megatron_pp_ext", "megatron_pp_ext.*"]),
    package_data={"megatron_pp_ext": ["data/*.txt"]},
    python_requires=">=3.10",
    # The schedule core (simulate) needs only matplotlib for pictures; the runtime needs torch and
    # megatron-core. torch is not pinned here: install the build for your machine first.
    install_requires=["matplotlib>=3.7", "tqdm>=4.60", "pyyaml>=6"],
    extras_require={
        # tensorboard: train's --tensorboard-dir (torch.utils.tensorboard writes through it);
        # transformers: --tokenizer-type HuggingFaceTokenizer (megatron-core's tokenizer reads it)
        "runtime": ["torch>=2.4", "megatron-core>=0.16,<0.17", "tensorboard>=2.14", "transformers>=4.40"],
        # einops: megatron-core's HyperCommGrid (the contract tests' custom process groups);
        # pytest-xdist: the suite runs on two workers (pyproject's addopts)
        "dev": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "ruff>=0.5", "einops"],
        # transformer-engine: from 2.3, which defers weight gradients (delay_wgrad_compute) as
        # B/W-split schedules on its layer spec need (checked at start, layer_spec.TE_WGRAD_VERSION);
        # below 2.12, the bound megatron-core 0.16.1 is developed and tested against (Megatron-LM
        # core_v0.16.1, pyproject.toml's dev extra, also in the megatron-core 0.16.1 wheel's
        # metadata: "transformer-engine[pytorch,core_cu13]>=2.9.0a0,<2.12.0"). The Dockerfile checks
        # the NGC image's TE against the same range.
        "gpu": ["transformer-engine[pytorch]>=2.3,<2.12", "flash-attn"],
        # What Megatron-LM's training package (pretrain_gpt.py, its argument parser) imports beyond
        # megatron-core; the tests of patches/ run it from ../shared/megatron-lm.
        "megatron-lm": ["six", "regex", "pydantic", "triton"],
    },
    entry_points={"console_scripts": ["megatron-pp-ext=megatron_pp_ext.cli:main"]},
)
