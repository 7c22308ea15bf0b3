"""The way back: a packed Volta-layout artifact -> an AutoAWQ GEMM checkpoint, bit-exact.

Packing an AWQ GEMM checkpoint and unpacking the artifact gives back the source's
``qweight``, ``qzeros`` and ``scales`` bit for bit (tests prove it), and every other tensor
unchanged. Linears the packer kept in fp16 come back as fp16 ``weight`` tensors.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import awq_config, pack_awq_gemm
from onecat.formats.files import write_json
from onecat.formats.staging import (
    DEFAULT_SHARD_BYTES,
    ShardWriter,
    check_output,
    copy_side_files,
    staged_directory,
)
from onecat.pack.artifact import open_packed
from onecat.pack.volta_layout import unpack_volta


def unpack_artifact(
    path: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    show_progress: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the packed artifact at ``path`` back as an AutoAWQ GEMM checkpoint at ``out``.

    Every tensor is checksum-verified while it is read. Raises OnecatError when the packed
    linears use several group sizes (AWQ GEMM has one per checkpoint).
    """
    path, out = Path(path), Path(out)
    check_output(out, path, overwrite=overwrite)
    art = open_packed(path)
    groups = Counter(art.manifest["linears"][p]["group_size"] for p in art.linear_prefixes())
    if len(groups) > 1:
        raise OnecatError(
            f"{path}: packed linears use group sizes {sorted(groups)}; an AutoAWQ GEMM "
            "checkpoint has a single group_size"
        )
    group_size = next(iter(groups)) if groups else art.quantization["group_size"]
    with staged_directory(out, path, overwrite, "unpack_artifact") as stage:
        writer = ShardWriter(stage, max_shard_bytes)
        prefixes = art.linear_prefixes()
        for prefix in tqdm(prefixes, desc="unpacking", disable=not show_progress):
            lin = art.get_linear(prefix)
            q, z, s = unpack_volta(lin.qweight, lin.scales_zeros, lin.group_size)
            for part, tensor in pack_awq_gemm(q, z, s).items():
                writer.add(f"{prefix}.{part}", tensor)
            if lin.bias is not None:
                writer.add(f"{prefix}.bias", lin.bias)
        for name in art.plain_tensor_names():
            writer.add(name, art.get_tensor(name))
        writer.finish()
        not_convert = art.quantization.get("modules_to_not_convert") or []
        write_json(stage / "config.json", awq_config(art.config, group_size, not_convert))
        copy_side_files(path, stage)
    return out
