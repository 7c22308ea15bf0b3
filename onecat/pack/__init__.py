"""The Volta packed layout and the artifacts that hold it (docs/FORMAT.md).

- ``volta_layout``: the layout itself (``pack_volta`` / ``unpack_volta`` / ``dequantize_volta``,
  the kernels' dequant contract);
- ``writer``: ``onecat pack``, an AutoAWQ GEMM or compressed-tensors checkpoint to a packed
  artifact; ``unpack``: the way back to AutoAWQ GEMM, bit-exact;
- ``artifact``: the packed-artifact reader (runtime and vLLM plugin);
- ``repack``: 4-bit checkpoint tensors to the Volta layout while loading;
- ``partitions``: whether a tensor-parallel rank's slice fits the layout.

Reading and decoding the source formats (AutoAWQ GEMM, compressed-tensors) is
:mod:`onecat.formats`'s.
"""
