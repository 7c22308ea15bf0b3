"""The shard plan of the AutoAWQ GEMM checkpoint ``onecat quantize`` writes (this module writes
nothing).

Shards are named ``model-XXXXX-of-YYYYY.safetensors``: first the tensors outside the decoder
layers (embeddings, lm_head, final norm, ``mtp.*``, ``model.visual.*``, copied unchanged),
then one shard per decoder layer. Writing itself (atomic shards, index, side files, the
staged work directory) is :mod:`onecat.formats.staging`'s.
"""

from __future__ import annotations

from onecat.formats.checkpoint import Checkpoint

REST_SHARD_BYTES = 2 << 30


def plan_rest_shards(reader: Checkpoint, rest: list[str]) -> list[list[str]]:
    """Group the non-layer tensors into shards of at most about 2 GiB (sorted by name)."""
    groups: list[list[str]] = []
    size = REST_SHARD_BYTES
    for name in sorted(rest):
        nbytes = reader.nbytes(name)
        if size + nbytes > REST_SHARD_BYTES and (not groups or groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return [g for g in groups if g]
