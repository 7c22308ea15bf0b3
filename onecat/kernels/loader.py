"""Find (or compile) the image for each kernel program and load it for a device.

Which image a device gets:

- ``ONECAT_KERNEL_ARCH=70`` (or ``sm_70``): the compute_70 PTX, JIT-compiled by the driver for
  the GPU present (on a newer GPU this runs exactly a V100's code), or the sm_70 cubin when
  the GPU is itself sm_70.  Without it the target is the GPU's own architecture.
- ``ONECAT_KERNEL_DIR=DIR``: the images prebuilt by ``onecat build-kernels --out DIR``; their
  manifest must carry the hash of these sources (a stale build is an error, never silently
  used).  Without it, NVRTC compiles at first use and caches the image on disk (build.py).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from onecat.errors import OnecatError
from onecat.kernels import build, driver


def forced_arch() -> str | None:
    """The architecture digits forced by ``ONECAT_KERNEL_ARCH`` (e.g. ``"70"``), or None."""
    value = os.environ.get("ONECAT_KERNEL_ARCH", "").strip()
    if not value:
        return None
    digits = re.sub(r"^(sm_|compute_)", "", value)
    if not digits.isdigit():
        raise OnecatError(f"ONECAT_KERNEL_ARCH={value!r} is not an architecture: use e.g. 70")
    return digits


def device_arch(device_index: int) -> str:
    """The compute capability of a CUDA device as digits, e.g. ``"70"`` or ``"90"``."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{major}{minor}"


def choose_target(device_index: int) -> str:
    """The NVRTC target for a device: ``compute_XY`` PTX or ``sm_XY`` cubin (see module doc)."""
    native = device_arch(device_index)
    forced = forced_arch()
    if forced is None:
        return f"sm_{native}"
    if int(forced) > int(native):
        raise OnecatError(
            f"ONECAT_KERNEL_ARCH={forced} is newer than the GPU (sm_{native}): unset it or "
            f"use {native} or lower"
        )
    return f"sm_{forced}" if forced == native else f"compute_{forced}"


def _prebuilt_image(directory: Path, program: str, target: str) -> bytes:
    manifest_path = directory / build.MANIFEST
    if not manifest_path.is_file():
        raise OnecatError(
            f"ONECAT_KERNEL_DIR={directory} has no {build.MANIFEST}: build it with "
            f"`onecat build-kernels --arch sm_70 --out {directory}`"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("sources_hash") != build.sources_hash():
        raise OnecatError(
            f"the kernels in ONECAT_KERNEL_DIR={directory} were built from other sources "
            f"(hash {manifest.get('sources_hash')}, this onecat has {build.sources_hash()}): "
            f"rebuild them with `onecat build-kernels --out {directory}`"
        )
    candidates = [target]
    if target.startswith("sm_"):  # a cubin for this GPU, else PTX of the same arch
        candidates.append(target.replace("sm_", "compute_"))
    for candidate in candidates:
        path = directory / f"{program}.{candidate}{build.image_suffix(candidate)}"
        if path.is_file():
            return path.read_bytes()
    raise OnecatError(
        f"ONECAT_KERNEL_DIR={directory} holds no {program} image for {target} (it was built "
        f"for sm_{manifest.get('arch')}): set ONECAT_KERNEL_ARCH={manifest.get('arch')} or "
        f"rebuild with `onecat build-kernels --arch {target.split('_')[1]}`"
    )


def program_image(program: str, target: str) -> bytes:
    """The image of ``program`` for ``target``: prebuilt (ONECAT_KERNEL_DIR) or NVRTC-cached."""
    directory = os.environ.get("ONECAT_KERNEL_DIR")
    if directory:
        return _prebuilt_image(Path(directory), program, target)
    return build.cached_image(program, target)


@functools.cache
def _module(program: str, device_index: int) -> driver.Module:
    target = choose_target(device_index)
    image = program_image(program, target)
    return driver.load_module(image, device_index, f"{program} ({target})")


@functools.cache
def get_kernel(name: str, device_index: int) -> driver.Kernel:
    """The loaded kernel ``name`` (e.g. ``w4a16_gemv_m1_w4``) for CUDA device ``device_index``."""
    program = build.program_of(name)
    if program is None:
        raise OnecatError(f"no kernel program defines {name!r}")
    return _module(program, device_index).function(name)


def loaded_target(device_index: int) -> str:
    """The target whose images this process loads for a device (for reports)."""
    return choose_target(device_index)
