"""Attention kernels for the kriging statistics (blockwise PyTorch, fused Triton)."""
