"""Tensor parallelism of the embedded runtime across the GPUs of one host.

- ``parallel_state``: this process's rank, the process group and the collectives the model
  calls (no-ops at tensor-parallel size 1);
- ``sharding``: which rows / columns / heads / experts a rank owns, the per-rank model
  config, and a weight source that slices checkpoint tensors (packed ones with
  ``onecat.pack.volta_layout.slice_volta``);
- ``executor``: the worker processes (ranks 1..N-1) and the runner rank 0 drives them with.
"""
