"""The one-shot all-reduce for tensor-parallel decode, beside NCCL (vLLM's custom all-reduce).

A decode step of the 27B at TP 2 makes 128 all-reduces of ``batch x 5120`` fp16 (10 KB at
batch 1); NCCL spends ~7 us on each. :class:`CustomAllReduce` sums such small tensors with
one kernel (``onecat/kernels/all_reduce.cu``: each rank stages its tensor in a buffer the
peers have mapped through CUDA IPC, flags them, and reads all ranks' staging buffers). It
needs peer access between every pair of the ranks' GPUs (NVLink or PCIe P2P) and 2, 4 or 8
ranks; :meth:`CustomAllReduce.create` returns None, with the reason logged, otherwise, and
``parallel_state.all_reduce`` then stays on NCCL. Tensors it does not take (:meth:`fits`:
not fp16, not contiguous, larger than :func:`max_message_bytes`) go to NCCL too.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from onecat.errors import OnecatError
from onecat.kernels import all_reduce as kernel

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = {2: 1 << 20, 4: 512 << 10, 8: 256 << 10}
"""Largest message per rank count (bytes); above it NCCL's ring moves less data: a one-shot
rank reads ``(N - 1) x size`` from its peers, a ring ``2 (N - 1) / N x size``, equal at N = 2.
The 27B's decode messages are 10 KB (batch 1) to 640 KB (batch 64)."""


def max_message_bytes(world_size: int) -> int:
    """The default size limit for ``world_size`` ranks (:data:`MAX_MESSAGE_BYTES`)."""
    return MAX_MESSAGE_BYTES[world_size]


def unavailable_reason(world_size: int, device: torch.device, device_indices: list[int] | None = None,
                       can_access_peer=None) -> str | None:
    """Why the custom all-reduce cannot run here, or None when it can: a CUDA device, 2, 4 or
    8 ranks and, given every rank's device index, peer access between every pair of them
    (``can_access_peer(i, j)``, default ``torch.cuda.can_device_access_peer``)."""
    if device.type != "cuda":
        return f"the ranks run on {device.type}, not CUDA"
    if world_size not in kernel.WORLD_SIZES:
        return f"it runs 2, 4 or 8 ranks, not {world_size}"
    if device_indices is None:
        return None
    access = can_access_peer or torch.cuda.can_device_access_peer
    for i in device_indices:
        for j in device_indices:
            if i != j and not access(i, j):
                return f"GPU {i} cannot access GPU {j}'s memory directly (no NVLink / PCIe P2P between them)"
    return None


class CustomAllReduce:
    """This rank's side of the one-shot all-reduce: its shared buffer, the peers' buffers
    mapped into this process and the kernel launch. Build it with :meth:`create`."""

    def __init__(self, launch: kernel.AllReduceLaunch, opened: list[int]) -> None:
        self.launch = launch
        self.max_bytes = launch.max_bytes
        self._opened = opened  # peers' buffers mapped here
        self._closed = False

    @classmethod
    def create(cls, rank: int, world_size: int, device: torch.device, max_bytes: int | None = None) -> CustomAllReduce | None:
        """Set it up on every rank of the (NCCL) default process group at once (collective:
        every rank must call it): allocate and zero the buffer, exchange IPC handles and
        device indices, check peer access between every pair, map the peers' buffers, load
        the kernel. Returns None on every rank, logging why, when any rank cannot."""
        reason = unavailable_reason(world_size, device)
        if reason is not None:
            logger.info("custom all-reduce off: %s; all-reduces use NCCL", reason)
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        max_bytes = max_bytes or max_message_bytes(world_size)
        own, handle = 0, bytes(kernel.IPC_HANDLE_BYTES)
        try:
            own, handle = kernel.allocate_shared(index, kernel.buffer_bytes(max_bytes))
        except (OnecatError, RuntimeError, OSError) as exc:  # never skip the collectives below
            reason = f"rank {rank}: {exc}"
        record = torch.tensor([int(own != 0), index, *handle], dtype=torch.uint8, device=device)
        parts = [torch.empty_like(record) for _ in range(world_size)]
        dist.all_gather(parts, record)
        rows = torch.stack(parts).cpu().tolist()
        failed = [r for r, row in enumerate(rows) if not row[0]]
        if failed and reason is None:
            reason = f"rank {failed[0]} could not allocate its buffer"
        if reason is None:
            reason = unavailable_reason(world_size, device, [row[1] for row in rows])
        bases, opened, launch = [], [], None
        if reason is None:
            try:
                for r, row in enumerate(rows):
                    if r == rank:
                        bases.append(own)
                    else:
                        bases.append(kernel.open_shared(index, bytes(row[2:])))
                        opened.append(bases[-1])
                launch = kernel.AllReduceLaunch(bases, rank, max_bytes, index)
            except (OnecatError, RuntimeError, OSError) as exc:
                reason = f"rank {rank}: {exc}"
        ok = torch.tensor([int(reason is None)], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if launch is not None and int(ok.item()) == 1:
            if rank == 0:
                logger.info("custom all-reduce on: %d ranks, messages up to %d KB (NCCL above)",
                            world_size, max_bytes >> 10)
            return cls(launch, opened)
        _release(index, own, opened)
        logger.warning("custom all-reduce off: %s; all-reduces use NCCL",
                       reason or "another rank could not set it up (its log says why)")
        return None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` takes ``x`` (``kernel.fits`` under this limit)."""
        return not self._closed and kernel.fits(x, self.max_bytes)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of ``x`` over the ranks, into ``out`` (default: ``x``, in place); returns
        it. ``x`` must pass :meth:`fits`; ``out`` must have ``x``'s shape and pass it too.
        Capturable in CUDA graphs (torch's current stream, no host sync). Every rank must
        make the same calls in the same order, with the same shapes."""
        out = x if out is None else out
        same = out is x or (self.fits(out) and out.shape == x.shape and out.device == x.device)
        if not (same and self.fits(x) and x.device.index == self.launch.device_index):
            raise OnecatError(
                "CustomAllReduce.all_reduce: x and out must be contiguous 16-byte aligned fp16 CUDA tensors "
                f"of the same shape on this rank's GPU, a multiple of 16 bytes up to {self.max_bytes} bytes "
                f"(got {tuple(x.shape)} {x.dtype} {x.device})"
            )
        self.launch(x, out)
        return out

    def norm_fits(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`add_rms_norm` takes these (``kernel.norm_fits`` under this limit, on
        this rank's GPU)."""
        return (not self._closed and kernel.norm_fits(x, residual, weight, self.max_bytes)
                and x.device.index == residual.device.index == weight.device.index == self.launch.device_index)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s) * (1 + weight), s)`` with ``s = all_reduce(x) + residual``: the
        all-reduce, the residual add and the next RMSNorm in one kernel (new output tensors;
        the inputs are left as they are). The arguments must pass :meth:`norm_fits`."""
        if not self.norm_fits(x, residual, weight):
            raise OnecatError(
                "CustomAllReduce.add_rms_norm: x and residual must be fp16 [rows <= "
                f"{kernel.MAX_BLOCKS}, hidden <= {kernel.NORM_MAX_HIDDEN}] contiguous CUDA tensors on this "
                f"rank's GPU and the weight fp32 [hidden] (got {tuple(x.shape)} {x.dtype}, "
                f"{tuple(residual.shape)} {residual.dtype}, {tuple(weight.shape)} {weight.dtype})"
            )
        out, summed = torch.empty_like(x), torch.empty_like(residual)
        self.launch.add_rms_norm(x, residual, weight, eps, out, summed)
        return out, summed

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (idempotent). No CUDA graph that
        captured a call may be replayed afterwards."""
        if self._closed:
            return
        self._closed = True
        launch = self.launch
        _release(launch.device_index, launch.bases[launch.rank], self._opened)


def _release(device_index: int, own: int, opened: list[int]) -> None:
    for ptr in opened:
        try:
            kernel.close_shared(device_index, ptr)
        except OnecatError as exc:
            logger.warning("custom all-reduce: %s", exc)
    if own:
        try:
            kernel.free_shared(device_index, own)
        except OnecatError as exc:
            logger.warning("custom all-reduce: %s", exc)
