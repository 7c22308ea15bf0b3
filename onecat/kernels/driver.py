"""The few CUDA driver API calls onecat needs: load a PTX/cubin module, find a kernel, launch it.

Why ctypes on ``libcuda`` and not ``cuda.bindings.driver``: the driver's C ABI for these calls
(cuModuleLoadDataEx, cuModuleGetFunction, cuLaunchKernel, ...) is the same in CUDA 12 and 13,
while the Python bindings change between cuda-bindings 12 and 13 (module layout, argument
packing); a V100 machine has cuda-bindings 12 and a new GPU may have 13.  ctypes also keeps the
per-launch cost to building one small pointer array, which matters for decode-sized launches.
NVRTC (compilation) does use cuda-bindings 12, see build.py.

Kernels run in the device's primary context, the one PyTorch uses, on torch's current stream.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from onecat.errors import OnecatError

_CU_JIT_ERROR_LOG_BUFFER = 5
_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_contexts: dict[int, ctypes.c_void_p] = {}


def _libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise OnecatError(
                "cannot load libcuda.so.1 (the NVIDIA driver): is an NVIDIA driver installed "
                "and this a GPU machine?"
            ) from exc
        _check(lib, lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def _check(lib: ctypes.CDLL, result: int, what: str, detail: str = "") -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    lib.cuGetErrorString(result, ctypes.byref(text))
    message = text.value.decode() if text.value else f"CUDA error {result}"
    raise OnecatError(f"CUDA driver call {what} failed: {message} ({result}){detail}")


def driver_version() -> tuple[int, int]:
    """The installed driver's CUDA version ``(major, minor)``, e.g. (13, 0)."""
    lib = _libcuda()
    version = ctypes.c_int()
    _check(lib, lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value // 1000, (version.value % 1000) // 10


def make_current(device_index: int) -> None:
    """Make the primary context of ``device_index`` (PyTorch's context) current on this thread."""
    lib = _libcuda()
    ctx = _contexts.get(device_index)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device_index)
            if ctx is None:
                dev = ctypes.c_int()
                _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
                ctx = ctypes.c_void_p()
                _check(
                    lib,
                    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain",
                )
                _contexts[device_index] = ctx
    current = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value != ctx.value:
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@dataclass
class Module:
    """A loaded PTX or cubin image."""

    handle: ctypes.c_void_p
    device_index: int

    def function(self, name: str) -> Kernel:
        """The ``extern "C"`` kernel ``name`` of this module."""
        lib = _libcuda()
        fn = ctypes.c_void_p()
        _check(
            lib,
            lib.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()),
            f"cuModuleGetFunction({name})",
        )
        return Kernel(name, fn, self.device_index)


def load_module(image: bytes, device_index: int, what: str) -> Module:
    """Load a PTX (NUL-terminated text) or cubin image into the device's primary context.

    PTX is JIT-compiled by the driver for the GPU present; a JIT error is raised with its log.
    """
    lib = _libcuda()
    make_current(device_index)
    log = ctypes.create_string_buffer(8192)
    options = (ctypes.c_int * 2)(_CU_JIT_ERROR_LOG_BUFFER, _CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
    values = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(len(log)))
    if not image.endswith(b"\0") and image[:4] != b"\x7fELF":
        image = image + b"\0"
    buf = ctypes.create_string_buffer(image, len(image))
    handle = ctypes.c_void_p()
    result = lib.cuModuleLoadDataEx(ctypes.byref(handle), buf, 2, options, values)
    detail = f" loading {what}" + (f":\n{log.value.decode(errors='replace')}" if log.value else "")
    _check(lib, result, "cuModuleLoadDataEx", detail)
    return Module(handle, device_index)


class Kernel:
    """A kernel function; :meth:`launch` runs it on a given CUDA stream."""

    def __init__(self, name: str, handle: ctypes.c_void_p, device_index: int) -> None:
        self.name = name
        self.handle = handle
        self.device_index = device_index
        self._occupancy: dict[int, int] = {}
        self._dynamic_shared = 48 * 1024  # what any launch may take without opting in

    def max_active_blocks(self, block: int) -> int:
        """Resident blocks of ``block`` threads per SM (the occupancy calculator's answer)."""
        cached = self._occupancy.get(block)
        if cached is None:
            lib = _libcuda()
            make_current(self.device_index)
            count = ctypes.c_int()
            _check(
                lib,
                lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(count), self.handle, block, ctypes.c_size_t(0)
                ),
                f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
            )
            cached = self._occupancy[block] = max(1, count.value)
        return cached

    def allow_dynamic_shared(self, size: int) -> None:
        """Let launches of this kernel take ``size`` bytes of dynamic shared memory (above
        48 KB a kernel must opt in: ``cuFuncSetAttribute``)."""
        if size <= self._dynamic_shared:
            return
        lib = _libcuda()
        make_current(self.device_index)
        _check(
            lib,
            lib.cuFuncSetAttribute(self.handle, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(size)),
            f"cuFuncSetAttribute({self.name}, max dynamic shared memory {size} bytes)",
        )
        self._dynamic_shared = size

    def launch(
        self,
        grid: tuple[int, int, int],
        block: int,
        stream: int,
        args: Sequence[ctypes._SimpleCData],
    ) -> None:
        """Launch with ``grid`` blocks of ``block`` threads on ``stream`` (a CUstream handle).

        ``args`` are ctypes values in the kernel's parameter order (``c_void_p`` for pointers,
        ``c_int`` for ints).
        """
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self.launch_params(grid, block, stream, params)

    def launch_params(
        self, grid: tuple[int, int, int], block: int, stream: int, params: ctypes.Array, shared: int = 0
    ) -> None:
        """Launch with a ready ``void*`` array pointing at the argument values and ``shared``
        bytes of dynamic shared memory (over 48 KB: :meth:`allow_dynamic_shared` first)."""
        lib = _libcuda()
        make_current(self.device_index)
        result = lib.cuLaunchKernel(
            self.handle, grid[0], grid[1], grid[2], block, 1, 1, shared, ctypes.c_void_p(stream), params, None
        )
        if result:
            _check(lib, result, f"cuLaunchKernel({self.name}, grid={grid}, block={block})")


class PreparedLaunch:
    """A kernel launch whose grid, block and argument storage are built once.

    Each call only stores the new argument values into the kept ctypes slots and calls
    ``cuLaunchKernel``: a few microseconds of Python, for decode-sized launches made outside
    CUDA graphs. One prepared launch must not be called from two threads at once (the
    engine launches from one thread).
    """

    def __init__(
        self, kernel: Kernel, grid: tuple[int, int, int], block: int, arg_types: Sequence[type], shared: int = 0
    ) -> None:
        self.kernel = kernel
        self.grid = grid
        self.block = block
        self.shared = shared
        if shared:
            kernel.allow_dynamic_shared(shared)
        self.args = [t() for t in arg_types]
        self.params = (ctypes.c_void_p * len(self.args))(*[ctypes.addressof(a) for a in self.args])

    def __call__(self, stream: int, *values: int) -> None:
        """Launch on ``stream`` with ``values`` (ints; pointers as ints) in parameter order."""
        for slot, value in zip(self.args, values, strict=True):
            slot.value = value
        self.kernel.launch_params(self.grid, self.block, stream, self.params, self.shared)
