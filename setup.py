"""megatron-ext: sparse language model families (STEM, StructMoE, Sigma MoE) for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-ext",
    version="0.1.0",
    description="Megatron-Core plugin for STEM, StructMoE and Sigma MoE pre-training",
    # The kernels' source is the top-level folder kernels/ (the project's layout: megatron_ext/
    # launch/ kernels/ tests/ ...), imported as megatron_ext_kernels: a top-level package named
    # "kernels" would collide with the Hugging Face package of that name.
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]) + ["megatron_ext_kernels"],
    package_dir={"megatron_ext_kernels": "kernels"},
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "tokenizers>=0.20",
        "transformers>=5.0",
        "safetensors>=0.4",
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        "tqdm",
        "numpy",
    ],
    extras_require={
        # GPU-only accelerators; the plugin imports and works without them.
        "gpu": ["transformer-engine[pytorch]", "triton"],
        "cpu-optimizer": ["deepspeed>=0.16"],
    },
)
