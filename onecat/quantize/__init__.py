"""Calibration, AWQ search and the streaming quantizer that writes AutoAWQ GEMM checkpoints."""
