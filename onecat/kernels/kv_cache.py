"""The encodings of a quantized KV cache (``--kv-cache-dtype``, vLLM's names), in torch.

A layer's cache is ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, KVH, D]``; its element
type names the encoding (:func:`cache_format`):

- ``auto``: fp16 (or the activations' dtype on CPU), stored as it is;
- ``fp8_e5m2``: uint8, the top byte of the fp16 value (sign, 5 exponent bits, 2 mantissa
  bits: e5m2 has fp16's exponent bias, so the byte shifted left by 8 IS the fp16 value, exactly).
  Writing rounds to nearest even on the fp16 bit pattern (the rounding bias ``0x7f`` plus the
  kept lowest bit is added to the dropped low byte) and saturates to the largest finite e5m2
  (57344) instead of making an infinity (infinities saturate too, NaN stays NaN: the
  ``satfinite`` rule);
- ``int8``: int8 codes ``q`` with one fp32 scale per token and KV head, ``k_scale`` /
  ``v_scale`` ``[num_blocks, block_size, KVH]`` beside the codes: symmetric,
  ``s = amax / 127`` over the head's D values (fp32 division), ``q = clamp(rne(x / s), -127,
  127)`` (0 where ``s`` is 0), value ``q * s`` in fp32.

These functions are the contract the CUDA kernels implement (``attention_prep.cu`` writes,
``paged_attention.cu`` and ``flash_prefill.cu`` read): on fp16 inputs the kernels' fp8 codes
are bit-equal to :func:`encode`'s, their int8 scales equal to 1e-6 and their int8 codes within
one step of :func:`encode`'s (measured on an H200: a few values on a code boundary round
apart). The runtime's torch path (``runtime.layers.attention``) uses them directly.
"""

from __future__ import annotations

import torch

from onecat.errors import OnecatError

FORMATS = ("auto", "fp8_e5m2", "int8")
"""Cache encodings (``--kv-cache-dtype`` values); ``auto`` stores the activations' dtype."""
STORAGE_DTYPES = {"fp8_e5m2": torch.uint8, "int8": torch.int8}
"""Element type of a quantized cache (fp8 is kept as its byte: torch's float8 types lack the
index ops the cache needs on CPU)."""
SCALE_DTYPE = torch.float32
"""Element type of the int8 cache's per-token, per-head scales."""
KERNEL_SUFFIX = {"auto": "", "fp8_e5m2": "_fp8", "int8": "_int8"}
"""What the CUDA kernels that read or write a cache of each encoding add to their names."""
E5M2_MAX = 57344.0
"""The largest finite fp8_e5m2 value (byte 0x7b)."""
INT8_MAX = 127


def check_format(name: str) -> str:
    """``name`` when it is one of :data:`FORMATS`; else OnecatError naming ``--kv-cache-dtype``."""
    if name not in FORMATS:
        raise OnecatError(f"--kv-cache-dtype {name!r} is not a KV-cache encoding onecat knows "
                          f"(choices: {', '.join(FORMATS)})")  # fmt: skip
    return name


def cache_format(cache: torch.Tensor) -> str:
    """The encoding of a cache tensor, from its element type: uint8 is ``fp8_e5m2``, int8 is
    ``int8``, a float type is ``auto``."""
    if cache.dtype == torch.uint8:
        return "fp8_e5m2"
    if cache.dtype == torch.int8:
        return "int8"
    return "auto"


def storage_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for encoding ``name`` (``auto``: ``activation_dtype``)."""
    return STORAGE_DTYPES.get(check_format(name), activation_dtype)


def encode_fp8_e5m2(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``x`` (any float dtype; rounded to fp16 first): the fp16 bit pattern
    rounded to nearest even at bit 8, its top byte, saturated to +-57344; NaN stays NaN."""
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    sign = bits & 0x8000
    magnitude = bits & 0x7FFF
    rounded = (magnitude + 0x7F + ((magnitude >> 8) & 1)) >> 8
    code = torch.clamp(rounded, max=0x7B)  # overflow and infinities: the largest finite value
    code = torch.where(magnitude > 0x7C00, torch.full_like(code, 0x7F), code)  # NaN
    return ((sign >> 8) | code).to(torch.uint8)


def decode_fp8_e5m2(codes: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The values of fp8_e5m2 ``codes`` (uint8) as ``dtype`` (exact: each is an fp16 value)."""
    bits = (codes.to(torch.int32) << 8).to(torch.int16)  # 0x8000.. wrap to negative int16: same bits
    return bits.view(torch.float16).to(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [..., D], scales fp32 [...])`` of ``x [..., D]``: per row of D values
    ``s = amax / 127`` and ``q = clamp(rne(x / s), -127, 127)`` in fp32 (0 where ``s`` is 0)."""
    values = x.float()
    scales = values.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ratio = torch.where(scales[..., None] > 0, values / safe[..., None], torch.zeros_like(values))
    codes = torch.round(ratio).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales`` (fp32, one rounding to ``dtype``): ``codes [..., D]``, ``scales [...]``."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def encode(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(data, scales)`` to store for values ``x [..., D]`` in encoding ``name`` (scales only
    for int8, else None; ``auto`` returns ``x`` itself)."""
    if check_format(name) == "fp8_e5m2":
        return encode_fp8_e5m2(x), None
    if name == "int8":
        return quantize_int8(x)
    return x, None


def decode(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The values of a stored cache slice (its encoding read from ``data``'s element type,
    :func:`cache_format`) as ``dtype``."""
    name = cache_format(data)
    if name == "fp8_e5m2":
        return decode_fp8_e5m2(data, dtype)
    if name == "int8":
        if scales is None:
            raise OnecatError("an int8 KV cache needs its per-token, per-head scales (k_scale / v_scale)")
        return dequantize_int8(data, scales, dtype)
    return data.to(dtype)


def roundtrip(x: torch.Tensor, name: str) -> torch.Tensor:
    """What reading ``x`` back from a cache of encoding ``name`` gives, in ``x``'s dtype."""
    if check_format(name) == "auto":
        return x
    data, scales = encode(x, name)
    return decode(data, scales, x.dtype)
