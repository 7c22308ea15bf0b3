"""The collectives of tensor parallelism across the GPUs of one host.

- ``parallel_state``: this process's rank, the process group and the collectives the model
  calls (no-ops at tensor-parallel size 1);
- ``custom_all_reduce``: the one-shot all-reduce over CUDA IPC buffers, and the choice
  between it and NCCL.

What drives them lives beside what it serves: the worker processes and the runner rank 0
drives them with in ``runtime/engine/executor.py``, which rows / columns / heads / experts a
rank owns (and the weight source that slices checkpoint tensors) in ``runtime/sharding.py``,
beside the loader.
"""
