"""Packaging for te-graph: the `te_graph`, `checkpointing` and `rng` packages."""
from setuptools import find_packages, setup

setup(
    name="te-graph",
    version="0.1.0",
    description=(
        "Per-layer CUDA graphs for Megatron-style training, with activation recompute "
        "inside the graphs and exact dropout randomness."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["te_graph", "te_graph.*", "checkpointing", "rng"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={
        # transformers: tests/test_hf_layers.py graphs its layers (a real client, as TE is).
        "test": ["pytest>=7", "pytest-xdist>=3", "transformers>=4.48"],
        "bench": ["tabulate>=0.9"],
        "examples": ["tqdm>=4", "matplotlib>=3.5"],
        "docs": [],
        # Transformer Engine layers and FP8: the version the GPU tests and bench_te.py ran with.
        "te": ["transformer_engine[pytorch]==2.20.2"],
        # CUDA conditional nodes (te_graph.capture.conditional): the driver calls and NVRTC.
        "conditional": ["cuda-bindings>=12.6"],
    },
)
