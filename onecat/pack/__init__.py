"""Checkpoint formats (AutoAWQ GEMM, compressed-tensors) and the Volta packed layout."""
