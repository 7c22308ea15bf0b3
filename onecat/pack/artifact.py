"""Reading a packed Volta-layout artifact (``onecat pack`` output; docs/FORMAT.md).

Used by the runtime and the vLLM plugin::

    art = open_packed(path)
    for prefix in art.linear_prefixes():
        lin = art.get_linear(prefix)      # PackedLinear(qweight, scales_zeros, group_size, ...)
    emb = art.get_tensor("model.language_model.embed_tokens.weight")

Opening validates the format name and version and that every tensor the manifest lists is in
its shard with the recorded dtype and shape (headers only); every file the manifest names must
lie inside the artifact directory (no ``..``, no absolute path, no symlink leading out).
Checksums are verified lazily: the
first read of each tensor hashes its bytes and compares them with the manifest's sha256 (a
mismatch is an OnecatError naming the tensor and file); :meth:`PackedArtifact.verify` checks
every tensor up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.formats.checkpoint import open_safetensors
from onecat.formats.files import contained_file, read_checkpoint_json
from onecat.formats.quant_config import find_quantization_config
from onecat.formats.staging import tensor_sha256
from onecat.pack.volta_layout import FORMAT_NAME, LAYOUT_VERSION, TILE
from onecat.pack.writer import MANIFEST_NAME


@dataclass
class PackedLinear:
    """One packed linear: Volta layout v1 tensors and its sizes."""

    qweight: torch.Tensor  # int32 [N/32, K/32, 32, 4]
    scales_zeros: torch.Tensor  # fp16 [N/32, K/g, 32, 2]
    group_size: int
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None


class PackedArtifact:
    """A validated packed artifact; tensors are read lazily and checksum-verified once each."""

    def __init__(self, path: Path, manifest: dict[str, Any], config: dict[str, Any]) -> None:
        """Use :func:`open_packed` instead."""
        self.path = path
        self.manifest = manifest
        self.config = config
        self._handles: dict[str, Any] = {}
        self._verified: set[str] = set()

    @property
    def quantization(self) -> dict[str, Any]:
        """config.json's ``quantization_config``."""
        return self.config["quantization_config"]

    def tensor_names(self) -> list[str]:
        """Every tensor of the artifact (packed linears' tensors included), sorted."""
        return sorted(self.manifest["tensors"])

    def linear_prefixes(self) -> list[str]:
        """Prefixes of the packed linears (``PREFIX.qweight`` / ``PREFIX.scales_zeros``)."""
        return sorted(self.manifest["linears"])

    def plain_tensor_names(self) -> list[str]:
        """Tensors that are not part of a packed linear (biases of packed linears excluded)."""
        owned = set()
        for prefix, entry in self.manifest["linears"].items():
            owned.update({f"{prefix}.qweight", f"{prefix}.scales_zeros"})
            if entry.get("bias"):
                owned.add(f"{prefix}.bias")
        return [n for n in self.tensor_names() if n not in owned]

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = open_safetensors(self.path / file)
        return self._handles[file]

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` on the CPU; verifies its sha256 on first read."""
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise OnecatError(f"tensor {name} is not in the packed artifact {self.path}")
        tensor = self._handle(entry["file"]).get_tensor(name)
        if name not in self._verified:
            if tensor_sha256(tensor) != entry["sha256"]:
                raise OnecatError(
                    f"checksum mismatch for tensor {name} in {self.path / entry['file']}: the "
                    "file is corrupted or was modified; re-run `onecat pack` to rebuild it"
                )
            self._verified.add(name)
        return tensor

    def get_linear(self, prefix: str) -> PackedLinear:
        """The packed linear ``prefix`` (see :meth:`linear_prefixes`)."""
        entry = self.manifest["linears"].get(prefix)
        if entry is None:
            raise OnecatError(f"{prefix} is not a packed linear in {self.path}")
        n, k, g = entry["out_features"], entry["in_features"], entry["group_size"]
        qweight = self.get_tensor(f"{prefix}.qweight")
        scales_zeros = self.get_tensor(f"{prefix}.scales_zeros")
        if tuple(qweight.shape) != (n // 32, k // 32, 32, 4) or tuple(
            scales_zeros.shape
        ) != (n // 32, k // g, 32, 2):
            raise OnecatError(
                f"{prefix} in {self.path}: tensor shapes {tuple(qweight.shape)} / "
                f"{tuple(scales_zeros.shape)} do not match the manifest ({n} x {k}, group {g})"
            )
        bias = self.get_tensor(f"{prefix}.bias") if entry.get("bias") else None
        return PackedLinear(qweight, scales_zeros, g, n, k, bias)

    def verify(self) -> None:
        """Read every tensor once and check its sha256 (OnecatError on the first mismatch)."""
        for name in self.tensor_names():
            self.get_tensor(name)


def check_onecat_config(qc: dict[str, Any], where: str) -> int:
    """Validate a packed artifact's ``quantization_config`` (``quant_method: onecat``, this
    format and version, 4 bits, a group size that is a positive multiple of 32); returns the
    group size. Used by :func:`open_packed` and the vLLM plugin."""
    found = (qc.get("quant_method"), qc.get("format"), qc.get("format_version"))
    if found != ("onecat", FORMAT_NAME, LAYOUT_VERSION):
        raise OnecatError(
            f"{where}: quant_method {found[0]!r} format {found[1]!r} version {found[2]!r}, but "
            f"this onecat reads 'onecat' {FORMAT_NAME!r} version {LAYOUT_VERSION}; re-pack the "
            "source checkpoint with this onecat's `onecat pack`"
        )
    if qc.get("bits") != 4:
        raise OnecatError(f"{where}: bits {qc.get('bits')!r}; onecat packs 4-bit weights only")
    group = qc.get("group_size")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % TILE:
        raise OnecatError(f"{where}: group_size {group!r} must be a positive multiple of {TILE}")
    return group


def open_packed(path: str | Path) -> PackedArtifact:
    """Open and validate the packed artifact at ``path`` (format name, version, tensor list).

    Raises OnecatError naming the file and the fix when it is not a onecat artifact, has
    another format version, or lacks tensors.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise OnecatError(
            f"{path} is not a onecat packed artifact ({MANIFEST_NAME} is missing); create one "
            "with `onecat pack SRC --out DST`"
        )
    manifest = read_checkpoint_json(path, MANIFEST_NAME)
    fmt, ver = manifest.get("format"), manifest.get("format_version")
    if fmt != FORMAT_NAME:
        raise OnecatError(
            f"{manifest_path}: format {fmt!r} is not {FORMAT_NAME!r}; this is not an artifact "
            "this onecat can read"
        )
    if ver != LAYOUT_VERSION:
        raise OnecatError(
            f"{manifest_path}: format_version {ver} is not supported (this onecat reads "
            f"version {LAYOUT_VERSION}); re-run `onecat pack` on the source checkpoint with "
            "this onecat, or install the onecat version that wrote the artifact"
        )
    config = read_checkpoint_json(path, "config.json")
    check_onecat_config(find_quantization_config(config) or {},
                        f"{path / 'config.json'}: quantization_config")
    artifact = PackedArtifact(path, manifest, config)
    _check_headers(artifact, _files_by_name(path, manifest, manifest_path))
    return artifact


def _files_by_name(path: Path, manifest: dict[str, Any], manifest_path: Path) -> dict[str, list[str]]:
    """The manifest's tensor names grouped by file, every file checked to lie inside ``path``."""
    tensors, linears = manifest.get("tensors"), manifest.get("linears")
    if not isinstance(tensors, dict) or not isinstance(linears, dict):
        raise OnecatError(
            f"{manifest_path}: 'tensors' and 'linears' must be JSON objects; the manifest is "
            "damaged, re-run `onecat pack`"
        )
    by_file: dict[str, list[str]] = {}
    for name, entry in tensors.items():
        file = entry.get("file") if isinstance(entry, dict) else None
        if file not in by_file:
            contained_file(path, file, where=str(manifest_path), entry=f"tensors[{name!r}].file")
        by_file.setdefault(file, []).append(name)
    return by_file


def _check_headers(artifact: PackedArtifact, by_file: dict[str, list[str]]) -> None:
    for file, names in sorted(by_file.items()):
        if not (artifact.path / file).is_file():
            raise OnecatError(
                f"{artifact.path / file} is missing; the artifact is incomplete, re-run `onecat pack`"
            )
        handle = artifact._handle(file)
        present = set(handle.keys())
        for name in names:
            entry = artifact.manifest["tensors"][name]
            if name not in present:
                raise OnecatError(
                    f"tensor {name} is missing from {artifact.path / file}; re-run `onecat pack`"
                )
            sl = handle.get_slice(name)
            if sl.get_dtype() != entry["dtype"] or list(sl.get_shape()) != entry["shape"]:
                raise OnecatError(
                    f"tensor {name} in {artifact.path / file} is {sl.get_dtype()} "
                    f"{list(sl.get_shape())}, the manifest says {entry['dtype']} {entry['shape']}; "
                    "re-run `onecat pack`"
                )
