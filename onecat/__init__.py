"""onecat: 4-bit Qwen3.5 on Tesla V100 (sm_70): AWQ quantizer, Volta W4A16 kernels, runtime."""

__version__ = "0.1.0"
