"""JSON files and file references that must stay inside a checkpoint directory.

A checkpoint names its own files: ``model.safetensors.index.json`` maps tensors to shards,
a packed artifact's ``onecat_manifest.json`` maps tensors to files. Those names come from the
file, not from the user, so each one is checked before it is opened: a relative path without
``..``, that after resolving symlinks still lies inside the checkpoint directory. The one
allowed way out is the Hugging Face hub cache, whose snapshot directories hold symlinks into
the repository's ``blobs/`` directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from onecat.errors import OnecatError


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``; OnecatError naming the file when missing or invalid."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise OnecatError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OnecatError(f"{path} is not valid JSON ({exc}); restore or re-create it") from None
    if not isinstance(data, dict):
        raise OnecatError(f"{path} must hold a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a trailing newline, atomically (temporary file in
    the same directory, then ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _allowed_roots(root: Path) -> list[Path]:
    """``root`` (resolved), plus the repository's ``blobs/`` for a hub-cache snapshot
    (``.../models--ORG--NAME/snapshots/REV``), whose files are symlinks into it."""
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def contained_file(root: Path, ref: object, *, where: str, entry: str) -> Path:
    """The path of file reference ``ref`` inside checkpoint directory ``root``.

    ``where`` names the file that holds the reference and ``entry`` the entry in it (both for
    the error). Raises OnecatError unless ``ref`` is a non-empty relative path without ``..``
    whose resolved location (symlinks followed) lies inside ``root``.
    """
    fix = (
        "a checkpoint may only name files inside its own directory, as plain relative paths; "
        "repair the entry or re-create the checkpoint"
    )
    if not isinstance(ref, str) or not ref.strip():
        raise OnecatError(f"{where}: {entry} is {ref!r}, not a file name; {fix}")
    posix, windows = PurePosixPath(ref), PureWindowsPath(ref)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ref.startswith(("/", "\\")):
        raise OnecatError(f"{where}: {entry} is the absolute path {ref!r}; {fix}")
    if ".." in posix.parts or ".." in windows.parts:
        raise OnecatError(f"{where}: {entry} {ref!r} climbs out with '..'; {fix}")
    base = Path(root).resolve()
    resolved = (base / ref).resolve()
    if not any(resolved.is_relative_to(allowed) for allowed in _allowed_roots(base)):
        raise OnecatError(
            f"{where}: {entry} {ref!r} is a symlink that leads outside {base} (to {resolved}); {fix}"
        )
    return Path(root) / ref


def read_checkpoint_json(root: Path, name: str) -> dict[str, Any]:
    """The JSON object in file ``name`` of checkpoint directory ``root`` (config.json, a
    manifest, an index), checked to lie inside ``root`` like every other reference."""
    return read_json(contained_file(root, name, where=str(root), entry="file"))
