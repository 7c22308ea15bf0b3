"""The one staged writer of checkpoint directories, and sharded safetensors output.

Every tool that writes a checkpoint (``quantize``, ``pack``, ``unpack``) builds it in a
work directory next to OUT and renames it into place only when complete
(:func:`publish`), so a failure or interruption never leaves a directory that looks
finished. Before anything is touched, :func:`check_output` refuses an OUT that is the
source, lies inside it or contains it (with or without ``--overwrite``): replacing OUT would
otherwise delete the source.

Every published directory carries a marker, :data:`OUTPUT_MARKER`: a JSON naming the command,
the onecat version and every file onecat wrote there. ``--overwrite`` replaces an existing OUT
only when that marker lists everything in it (:func:`check_replaceable`): a directory holding
anything else (a user's notes, another tool's artifact, an output of an onecat older than the
marker) is refused before anything is touched, naming a file that would be lost. No command
deletes a file it did not write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from onecat.errors import OnecatError
from onecat.formats.checkpoint import DTYPE_BYTES, INDEX_NAME, WEIGHT_SUFFIXES, open_safetensors
from onecat.formats.files import contained_file, write_json

DEFAULT_SHARD_BYTES = 2 * 1024**3
"""Shards close once they reach this size (a single larger tensor gets its own shard)."""

REWRITTEN_FILES = ("config.json", "onecat_manifest.json", "quant_config.json")
"""Top-level files that tools rewrite instead of copying."""

OUTPUT_MARKER = ".onecat-output.json"
"""The marker :func:`publish` writes into every directory it publishes: ``{"written_by":
"onecat", "command", "onecat_version", "files"}``, ``files`` being every file of the directory
(relative POSIX paths) but the marker. Hidden, so readers and :func:`copy_side_files` pass it by."""

SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def _overlap(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_no_overlap(out: Path, src: Path, work: Path | None = None) -> None:
    """OnecatError when ``out`` (or the work directory ``work`` that will be renamed to it) is
    ``src``, lies inside it or contains it. Paths are compared after resolving symlinks."""
    out, src = Path(out), Path(src)
    for target, what in ((out, "--out"), (work, "the work directory")):
        if target is not None and _overlap(target, src):
            raise OnecatError(
                f"{what} {target} must not be, lie inside or contain the source {src} "
                f"(resolved: {Path(target).resolve()} and {src.resolve()}): writing it would "
                "destroy the source. Choose an output directory outside the source"
            )


def onecat_version() -> str:
    """The installed onecat version (``unknown`` when running from an uninstalled tree)."""
    try:
        return version("onecat")
    except PackageNotFoundError:
        return "unknown"


def _entries(directory: Path) -> tuple[list[str], list[str]]:
    """``(files, directories)`` under ``directory`` as sorted relative POSIX paths; symlinks
    (to directories too) count as files and are not followed."""
    files, dirs = [], []
    for root, dirnames, filenames in os.walk(directory):
        rel = Path(root).relative_to(directory)
        for name in list(dirnames):
            if (Path(root) / name).is_symlink():
                dirnames.remove(name)
                filenames.append(name)
            else:
                dirs.append((rel / name).as_posix())
        files += [(rel / name).as_posix() for name in filenames]
    return sorted(files), sorted(dirs)


def write_marker(directory: Path, command: str) -> None:
    """Write :data:`OUTPUT_MARKER` into ``directory``, listing every file in it."""
    files = [f for f in _entries(Path(directory))[0] if f != OUTPUT_MARKER]
    write_json(Path(directory) / OUTPUT_MARKER, {
        "written_by": "onecat",
        "command": command,
        "onecat_version": onecat_version(),
        "files": files,
    })


def _marker_files(path: Path) -> set[str] | None:
    """The files :data:`OUTPUT_MARKER` of ``path`` lists, or None when it is absent or unreadable."""
    try:
        marker = json.loads((path / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != "onecat":
        return None
    files = marker.get("files")
    if not isinstance(files, list):
        return None
    return {f for f in files if isinstance(f, str)}


def check_replaceable(path: Path, written: Callable[[str], bool] | None = None) -> None:
    """OnecatError unless replacing ``path`` would delete only what onecat wrote there.

    Absent and empty directories pass. Otherwise every file must be :data:`OUTPUT_MARKER` or
    listed by it, or, where the caller knows the exact names it writes without a marker (an
    interrupted quantize run, a kernel directory), satisfy ``written`` (a relative POSIX path
    -> bool); every directory must hold such files. A file, a symlink, a directory without
    the marker or with anything else is refused, naming one file that would be lost.
    """
    path = Path(path)
    how = (f"Nothing was changed. Choose another --out, or move what you need out of {path} "
           "(or remove it yourself)")
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        raise OnecatError(f"{path} is {'a symlink' if path.is_symlink() else 'a file'}, not a "
                          f"directory onecat wrote; replacing it would delete it. {how}")
    files, dirs = _entries(path)
    if not files and not dirs:
        return
    listed = _marker_files(path)
    if listed is None and written is None:
        lost = path / (files or dirs)[0]
        raise OnecatError(
            f"{path} holds no onecat output marker {OUTPUT_MARKER} (or an unreadable one): it "
            "was not written by onecat, or by an onecat older than the marker, so --overwrite "
            f"could delete files onecat did not write, such as {lost}. {how}"
        )
    known = set(listed or ()) | {OUTPUT_MARKER}
    kept = {Path(f).parent.as_posix() for f in files}
    for name in files:
        if name not in known and not (written is not None and written(name)):
            raise OnecatError(
                f"{path / name} was not written by onecat"
                + (f" (it is not listed in {path / OUTPUT_MARKER})" if listed is not None else "")
                + f": replacing {path} would delete it. {how}"
            )
    for name in dirs:
        if not any(k == name or k.startswith(name + "/") for k in kept):
            raise OnecatError(f"{path / name} is a directory onecat did not write: replacing "
                              f"{path} would delete it. {how}")


def check_output(out: Path, src: Path, *, overwrite: bool) -> None:
    """Refuse, before anything is written, an output that would destroy its source
    (:func:`check_no_overlap`, whatever ``overwrite`` says), replace an existing ``out``
    without ``overwrite``, or delete with it a file onecat did not write
    (:func:`check_replaceable`)."""
    out = Path(out)
    check_no_overlap(out, src)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OnecatError(f"{out} already exists; pass --overwrite to replace it")
        check_replaceable(out)


def publish(work: Path, out: Path, command: str) -> None:
    """Mark the finished directory ``work`` as written by ``command`` (:func:`write_marker`)
    and move it to ``out``, replacing a previous ``out`` (checked again first:
    :func:`check_replaceable`, in case something was put there during the run)."""
    check_replaceable(out)
    write_marker(work, command)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists() or out.is_symlink():
        os.replace(out, old)
    os.replace(work, out)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()


@contextlib.contextmanager
def staged_directory(out: Path, src: Path, overwrite: bool, command: str) -> Iterator[Path]:
    """Yield a fresh staging directory next to ``out``; on success it replaces ``out``
    (:func:`publish`, with the marker naming ``command``).

    :func:`check_output` runs first. On any exception (a refusal by :func:`publish` too) the
    staging directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    check_output(out, src, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        yield stage
        publish(stage, out, command)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as safetensors stores them (row-major, little-endian)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def shard_name(number: int, total: int) -> str:
    """``model-00003-of-00042.safetensors`` (1-based)."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors shard atomically, with the permissions the umask gives."""
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise OnecatError(f"tensor {name} has dtype {tensor.dtype}, which is not supported")
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous() for k, v in sorted(tensors.items())}, str(tmp),
              metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates files owner-only
    os.replace(tmp, path)


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    """``model.safetensors.index.json`` with a sorted weight map and the total tensor bytes
    (read from the written shards' headers)."""
    total = 0
    for shard in sorted(set(weight_map.values())):
        handle = open_safetensors(directory / shard)
        for name in handle.keys():
            sl = handle.get_slice(name)
            count = 1
            for dim in sl.get_shape():
                count *= dim
            total += count * DTYPE_BYTES.get(sl.get_dtype(), 1)
    write_json(directory / INDEX_NAME,
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def side_file_names(src: Path) -> list[str]:
    """The top-level non-weight files (tokenizer, chat template, generation config, ...) of
    checkpoint ``src`` that :func:`copy_side_files` copies: rewritten files
    (:data:`REWRITTEN_FILES`), weight files, weight indexes and hidden files are left out."""
    return [
        item.name for item in sorted(Path(src).iterdir())
        if not (
            item.name.startswith(".")
            or item.name in REWRITTEN_FILES
            or item.name.endswith(WEIGHT_SUFFIXES)
            or item.name.endswith(".index.json")
            or not item.is_file()
        )
    ]


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the side files of checkpoint ``src`` (:func:`side_file_names`) to ``dst``; returns
    their names. A side file that is a symlink leading outside ``src`` is an OnecatError."""
    copied = side_file_names(src)
    for name in copied:
        contained_file(src, name, where=str(src), entry="side file")
        shutil.copyfile(Path(src) / name, dst / name)
    return copied


class ShardWriter:
    """Collects tensors into safetensors shards of bounded size with an HF
    ``model.safetensors.index.json``, recording dtype, shape, shard and sha256 of each tensor."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """Write shards into ``directory``, each up to ``max_shard_bytes``."""
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.entries: dict[str, dict[str, Any]] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name`` (written when its shard is full or at finish)."""
        if name in self.entries:
            raise OnecatError(f"tensor {name} would be written twice; the source is inconsistent")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise OnecatError(f"tensor {name} has dtype {tensor.dtype}, which is not supported")
        tensor = tensor.detach().contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "sha256": tensor_sha256(tensor),
        }
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards) + 1
        write_shard(self.directory / f"shard-{index:05d}.safetensors", self._pending)
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> dict[str, dict[str, Any]]:
        """Write the last shard and the index; returns ``{name: {file, dtype, shape, sha256}}``."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards, start=1):
            final = shard_name(i, count)
            os.replace(self.directory / f"shard-{i:05d}.safetensors", self.directory / final)
            for name in names:
                weight_map[name] = final
                self.entries[name]["file"] = final
        write_index(self.directory, weight_map)
        return self.entries
