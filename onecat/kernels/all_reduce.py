"""The one-shot all-reduce kernel (``all_reduce.cu``) and the CUDA IPC buffers it works in.

Each rank allocates one buffer (:func:`allocate_shared`: control words, flags written by the
peers, two staging buffers; layout in the kernel's header comment, offsets mirrored below),
hands its IPC handle to the peers, and maps theirs (:func:`open_shared`). An
:class:`AllReduceLaunch` then sums an fp16 tensor over the ranks in one kernel launch on
torch's current stream, capturable in CUDA graphs. The process group, the handle exchange
and the choice between this and NCCL live in ``onecat.runtime.distributed.custom_all_reduce``.

The buffers are ``cuMemAlloc`` allocations of their own (not torch's caching allocator), so an
IPC handle names exactly the buffer and nothing else of the process's memory.
"""

from __future__ import annotations

import ctypes

import torch

from onecat.errors import OnecatError
from onecat.kernels import driver
from onecat.kernels.driver import PreparedLaunch
from onecat.kernels.loader import get_kernel

WORLD_SIZES = (2, 4, 8)
"""Rank counts with a kernel (``all_reduce_w<N>``)."""
MAX_RANKS = 8  # all_reduce.cu kMaxRanks
MAX_BLOCKS = 64  # kMaxBlocks: rows of the flag array
THREADS = 512  # kThreads
TICKET_OFFSET = 128  # kTicketOffset
FLAGS_OFFSET = 4096  # kFlagsOffset
STAGING_OFFSET = 8192  # kStagingOffset
GRID_LIMIT = 36
"""Most blocks a call launches (vLLM's choice for its one-shot kernel); at most MAX_BLOCKS and
fewer than any GPU's SM count, so every block of a call is resident at once."""
VECTOR_BYTES = 16  # one thread moves 8 fp16 values at a time
NORM_THREADS = 256  # kNormThreads: one block of the fused kernel per row
NORM_VECTORS = 4  # kNormVectors: 16-byte vectors of the row a thread holds
NORM_MAX_HIDDEN = 8 * NORM_THREADS * NORM_VECTORS
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def buffer_bytes(max_bytes: int) -> int:
    """Size of one rank's shared buffer for messages of up to ``max_bytes``."""
    return STAGING_OFFSET + 2 * stage_bytes(max_bytes)


def stage_bytes(max_bytes: int) -> int:
    """Size of one staging buffer: ``max_bytes`` rounded up to whole 16-byte vectors."""
    return -(-max_bytes // VECTOR_BYTES) * VECTOR_BYTES


def grid_size(vectors: int) -> int:
    """Blocks of a call over ``vectors`` 16-byte vectors (a function of the size only, so
    every rank launches the same grid for the same call)."""
    return max(1, min(GRID_LIMIT, -(-vectors // THREADS)))


def fits(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether the kernel can sum ``x``: a CUDA tensor that :func:`eligible` accepts."""
    return x.is_cuda and eligible(x, max_bytes)


def eligible(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether ``x`` has what the kernel needs, device aside: fp16, contiguous, 16-byte
    aligned, a whole number of 16-byte vectors, not empty, at most ``max_bytes``. Depends
    only on what every rank has alike for the same call (shape, dtype, layout), so all ranks
    choose the same path."""
    nbytes = x.numel() * x.element_size()
    return (
        x.dtype == torch.float16
        and x.is_contiguous()
        and 0 < nbytes <= max_bytes
        and nbytes % VECTOR_BYTES == 0
        and x.data_ptr() % VECTOR_BYTES == 0
    )


def norm_fits(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, max_bytes: int) -> bool:
    """Whether the fused kernel (``all_reduce_add_rms_norm_w<N>``) takes these: ``x`` and
    ``residual`` fp16 ``[rows, hidden]`` that :func:`fits` accepts, rows at most one block per
    flag row (``MAX_BLOCKS``), hidden a multiple of 8 up to ``NORM_MAX_HIDDEN``, the norm's
    weight fp32 ``[hidden]``, 16-byte aligned. Shape, dtype and layout only: every rank
    decides alike."""
    return (
        fits(x, max_bytes)
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_BLOCKS
        and x.shape[1] % 8 == 0
        and x.shape[1] <= NORM_MAX_HIDDEN
        and residual.shape == x.shape
        and fits(residual, max_bytes)
        and weight.dtype == torch.float32
        and weight.shape == (x.shape[1],)
        and weight.is_contiguous()
        and weight.data_ptr() % VECTOR_BYTES == 0
    )


def allocate_shared(device_index: int, nbytes: int) -> tuple[int, bytes]:
    """A zeroed device buffer of ``nbytes`` on ``device_index`` and its IPC handle (64
    bytes). The memset has finished when this returns, so a peer may signal into it as soon
    as it has the handle. Free it with :func:`free_shared`."""
    lib = driver._libcuda()
    driver.make_current(device_index)
    ptr = ctypes.c_uint64()
    driver._check(lib, lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc",
                  f" ({nbytes} bytes for the custom all-reduce)")
    try:
        driver._check(lib, lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)), "cuMemsetD8")
        driver._check(lib, lib.cuCtxSynchronize(), "cuCtxSynchronize")
        handle = _IpcHandle()
        driver._check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr), "cuIpcGetMemHandle")
    except OnecatError:
        lib.cuMemFree_v2(ptr)
        raise
    return ptr.value, bytes(handle)


def open_shared(device_index: int, handle: bytes) -> int:
    """Map a peer's buffer (its IPC handle from :func:`allocate_shared`) into this process;
    returns its device address here. Unmap it with :func:`close_shared`."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise OnecatError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    lib = driver._libcuda()
    driver.make_current(device_index)
    ptr = ctypes.c_uint64()
    raw = _IpcHandle.from_buffer_copy(handle)
    driver._check(lib, lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)),
                  "cuIpcOpenMemHandle")
    return ptr.value


def close_shared(device_index: int, ptr: int) -> None:
    """Unmap a peer's buffer mapped by :func:`open_shared`."""
    lib = driver._libcuda()
    driver.make_current(device_index)
    driver._check(lib, lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


def free_shared(device_index: int, ptr: int) -> None:
    """Free a buffer from :func:`allocate_shared`."""
    lib = driver._libcuda()
    driver.make_current(device_index)
    driver._check(lib, lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")


class AllReduceLaunch:
    """Launches ``all_reduce_w<N>`` for this rank over the ranks' mapped buffers.

    ``bases[q]`` is rank q's buffer as mapped in this process (``bases[rank]`` this rank's
    own), each of :func:`buffer_bytes` ``(max_bytes)``. Loading the kernel happens here, so a
    missing kernel image fails at set-up and never during CUDA-graph capture.
    """

    def __init__(self, bases: list[int], rank: int, max_bytes: int, device_index: int) -> None:
        world = len(bases)
        if world not in WORLD_SIZES or not 0 <= rank < world:
            raise OnecatError(f"the custom all-reduce runs {WORLD_SIZES} ranks; got rank {rank} of {world}")
        self.bases, self.rank, self.max_bytes, self.device_index = list(bases), rank, max_bytes, device_index
        self.kernel = get_kernel(f"all_reduce_w{world}", device_index)
        self.norm_kernel = get_kernel(f"all_reduce_add_rms_norm_w{world}", device_index)
        self._fixed = [*self.bases, *[0] * (MAX_RANKS - world), self.bases[rank], rank, stage_bytes(max_bytes)]
        self._launches: dict[int, PreparedLaunch] = {}
        self._norm_launches: dict[int, PreparedLaunch] = {}

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Sum ``x`` over the ranks into ``out`` (may be ``x``) on torch's current stream.
        Both must pass :func:`fits` and have the same shape; every rank calls with the same
        shapes in the same order."""
        vectors = x.numel() * x.element_size() // VECTOR_BYTES
        launch = self._launches.get(vectors)
        if launch is None:
            p, i = ctypes.c_void_p, ctypes.c_int
            arg_types = [p] * (MAX_RANKS + 1) + [i, ctypes.c_ulonglong, p, p, i]
            launch = self._launches[vectors] = PreparedLaunch(self.kernel, (grid_size(vectors), 1, 1), THREADS, arg_types)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        launch(stream, *self._fixed, x.data_ptr(), out.data_ptr(), vectors)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, residual_out: torch.Tensor) -> None:
        """``residual_out = sum over ranks of x + residual`` and ``out = rms_norm(residual_out)
        * (1 + weight)``, with the roundings of an all-reduce followed by ``add_rms_norm``, in one
        launch on torch's current stream. All four fp16 tensors ``[rows, hidden]`` must pass
        :func:`norm_fits`; every rank calls with the same shapes in the same order."""
        rows = x.shape[0]
        launch = self._norm_launches.get(rows)
        if launch is None:
            p, i = ctypes.c_void_p, ctypes.c_int
            arg_types = [p] * (MAX_RANKS + 1) + [i, ctypes.c_ulonglong, p, p, p, p, p, i, ctypes.c_float]
            launch = self._norm_launches[rows] = PreparedLaunch(self.norm_kernel, (rows, 1, 1), NORM_THREADS, arg_types)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        launch(stream, *self._fixed, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
               residual_out.data_ptr(), x.shape[1], eps)
