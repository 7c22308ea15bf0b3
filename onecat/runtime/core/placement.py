"""Where each data-parallel replica runs: its GPUs, its share of their memory, its threads.

``--data-parallel-size N`` with ``-tp k`` asks for N x k GPUs. Replica i takes GPUs
``i*k .. i*k + k - 1`` (of those this process sees), through ``CUDA_VISIBLE_DEVICES`` in its
core process, so its own ranks see them as ``cuda:0 .. cuda:k-1``. With fewer GPUs than
N x k the replicas wrap around and share GPUs (two 35B-A3B replicas on one 141 GB card):
each sharing replica then plans its KV cache as the ``--gpu-memory-utilization`` of the
card times (replicas already up on it + 1) / (replicas sharing it), because an engine
counts the memory other processes hold against that fraction (``ModelRunner._plan_memory``)
and so takes what is left of its share. Replicas that share a GPU start one after the
other, so each one's plan sees the others' memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from onecat.errors import OnecatError


@dataclass(frozen=True)
class Placement:
    """One replica's GPUs (indices this process sees; empty on CPU), how many replicas
    share them, and its torch thread count on CPU (None: torch's default)."""

    index: int
    gpus: tuple[int, ...]
    sharing: int
    threads: int | None = None

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The core process's environment: ``base`` with ``CUDA_VISIBLE_DEVICES`` naming its
        GPUs (mapped through this process's own ``CUDA_VISIBLE_DEVICES``)."""
        env = dict(base)
        if self.gpus:
            visible = base.get("CUDA_VISIBLE_DEVICES")
            names = [name.strip() for name in visible.split(",")] if visible else None
            env["CUDA_VISIBLE_DEVICES"] = ",".join(names[g] if names else str(g) for g in self.gpus)
        return env

    def memory_utilization(self, utilization: float, others_up: int) -> float:
        """The ``gpu_memory_utilization`` this replica plans with while ``others_up``
        replicas sharing its GPUs hold their memory (module docstring)."""
        if self.sharing == 1:
            return utilization
        return utilization * min(self.sharing, others_up + 1) / self.sharing


def place_replicas(data_parallel_size: int, tensor_parallel_size: int, device: str, num_gpus: int) -> list[Placement]:
    """The placement of each replica (module docstring); OnecatError for a request that
    cannot be placed (a fixed ``cuda:N`` device with several replicas, more GPUs per replica
    than the host has)."""
    if data_parallel_size < 1:
        raise OnecatError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    if device == "cpu" or (device == "auto" and num_gpus == 0):
        threads = max(1, (os.cpu_count() or 1) // data_parallel_size) if data_parallel_size > 1 else None
        return [Placement(i, (), 1, threads) for i in range(data_parallel_size)]
    if device not in ("auto", "cuda"):
        if data_parallel_size > 1:
            raise OnecatError(
                f"--device {device} names one GPU, but --data-parallel-size {data_parallel_size} "
                "places replicas on GPUs itself: use --device auto (and CUDA_VISIBLE_DEVICES to "
                "choose the GPUs)"
            )
        return [Placement(0, (), 1)]
    if num_gpus == 0:
        raise OnecatError("--device cuda was asked for, but torch sees no CUDA GPU; use --device cpu")
    if tensor_parallel_size > num_gpus:
        raise OnecatError(
            f"-tp {tensor_parallel_size} needs {tensor_parallel_size} GPUs per replica; this host "
            f"has {num_gpus}"
        )
    gpus = [tuple((i * tensor_parallel_size + j) % num_gpus for j in range(tensor_parallel_size))
            for i in range(data_parallel_size)]
    users = [sum(g in replica for replica in gpus) for g in range(num_gpus)]
    return [Placement(i, gpus[i], max(users[g] for g in gpus[i])) for i in range(data_parallel_size)]
