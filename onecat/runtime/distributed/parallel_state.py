"""This process's tensor-parallel rank and the collectives the model calls.

Rank 0 is the engine's process (scheduler, sampling); ranks 1..N-1 are worker processes
(``runtime/engine/executor.py``). At size 1 (the default, nothing initialised) every
function here is a no-op, so single-GPU code pays nothing.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from onecat.runtime.layers.norm import add_rms_norm

if TYPE_CHECKING:
    from onecat.runtime.distributed.custom_all_reduce import CustomAllReduce

_rank = 0
_world_size = 1
_device = torch.device("cpu")
_custom: CustomAllReduce | None = None  # the one-shot all-reduce, when set up
logger = logging.getLogger(__name__)


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, custom_all_reduce: bool = True
) -> None:
    """Join the process group of ``world_size`` ranks (NCCL for CUDA devices, gloo on CPU).

    On CUDA with ``custom_all_reduce`` (``not EngineConfig.disable_custom_all_reduce``) it
    also sets up the one-shot all-reduce (``custom_all_reduce.CustomAllReduce``), which
    :func:`all_reduce` uses for the tensors it takes; where it cannot run (no peer access,
    3 ranks, ...) the reason is logged and NCCL does every all-reduce."""
    global _rank, _world_size, _device, _custom
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(minutes=30)
    )
    _rank, _world_size, _device = rank, world_size, device
    if custom_all_reduce and device.type == "cuda" and world_size > 1:
        from onecat.runtime.distributed.custom_all_reduce import CustomAllReduce

        _custom = CustomAllReduce.create(rank, world_size, device)


def destroy_tensor_parallel() -> None:
    """Leave the process group (back to size 1), freeing the custom all-reduce's buffers."""
    global _rank, _world_size, _custom
    custom, _custom = _custom, None
    if dist.is_initialized() or custom is not None:
        # abort does not wait for peers (the workers have exited) and leaves torch ready for
        # a new group; either call can still hang in NCCL (pytorch#115388, when CUDA graphs
        # holding its collectives are alive), and freeing the custom all-reduce's buffer
        # waits for a kernel still spinning on a dead peer: bounded, so closing an engine
        # never hangs
        done = threading.Thread(target=_leave_group, args=(custom,), daemon=True)
        done.start()
        done.join(timeout=20)
        if done.is_alive():
            logger.warning("the tensor-parallel process group did not shut down within 20 s; "
                           "this process cannot start another tensor-parallel engine")
    _rank, _world_size = 0, 1


def _leave_group(custom: CustomAllReduce | None = None) -> None:
    if custom is not None:
        custom.close()
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() == "nccl":
        abort()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    """This process's rank (0 without tensor parallelism)."""
    return _rank


def tp_size() -> int:
    """Number of tensor-parallel ranks (1 without tensor parallelism)."""
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (the one collective after each attention / GDN
    mixer and each MLP / MoE block); returns ``x``. The one-shot kernel when it is set up
    and takes ``x`` (fp16, contiguous, up to its size limit: decode steps), else NCCL (or
    gloo on CPU). Capturable in CUDA graphs either way."""
    if _world_size > 1:
        if _custom is not None and _custom.fits(x):
            _custom.all_reduce(x)
        else:
            dist.all_reduce(x)
    return x


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(x), residual, weight, eps)``: a row-parallel output summed
    over the ranks, the residual added, the next RMSNorm ``(1 + w)`` applied; returns
    (normed, new residual). One fused launch of the one-shot kernel where it takes the
    tensors (decode-sized rows), else the all-reduce and the compiled norm, as at one rank."""
    if _custom is not None and _custom.norm_fits(x, residual, weight):  # set up at TP > 1 only
        return _custom.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm(all_reduce(x), residual, weight, eps)


def min_over_ranks(*values: int) -> tuple[int, ...]:
    """The element-wise minimum of ``values`` over all ranks (e.g. KV blocks every rank fits)."""
    if _world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return tuple(int(v) for v in t.tolist())


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` of every rank side by side in rank order: ``[..., world_size * n]``
    (the vocab-parallel ``lm_head``: each rank computes the logits of its rows of the
    vocabulary). One all-gather into a fresh tensor (rank-major), then one copy that puts the
    ranks' columns next to each other; capturable in CUDA graphs (NCCL), like
    :func:`all_reduce`. Returns ``x`` itself at size 1."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    gathered = x.new_empty((_world_size, *x.shape))
    _all_gather_flat(gathered.view(-1), x.view(-1))
    return gathered.movedim(0, -2).flatten(-2)


# newer torch deprecates all_gather_into_tensor for all_gather_single (the same collective)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
