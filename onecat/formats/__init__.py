"""On-disk formats, in one place: every tool that reads or writes a checkpoint goes through here.

- ``files``: JSON files and :func:`~onecat.formats.files.contained_file`, which keeps every
  file reference of a checkpoint (index weight maps, manifests) inside its directory;
- ``checkpoint``: the safetensors checkpoint reader (lazy, header-indexed, containment-checked);
- ``staging``: the staged writer (temporary sibling, overlap checks, ``os.replace``), sharded
  safetensors output and side-file copying;
- ``integers``: onecat's 4-bit integer contract ``(q - z) * s`` and its one dequantiser;
- ``awq_gemm``: the AutoAWQ GEMM codec; ``compressed_tensors``: the compressed-tensors
  ``pack-quantized`` codec;
- ``quant_config``: reading ``quantization_config`` and recognising the format of a checkpoint.

This package imports nothing of onecat but ``onecat.errors``.
"""
