"""sm_70 W4A16 CUDA kernels compiled by NVRTC, their loader, torch ops, tuner and doctor."""
