"""tilefuse: fused Triton kernels for large-model inference and training."""

__version__ = "0.1.0"
