"""The fused attention-input kernel's contract (``onecat/kernels/attention_prep.cu``) in fp64,
with its fp16 rounding points; shared by the CPU tests (against the runtime's torch path) and
the GPU tests (against the kernel)."""

from __future__ import annotations

import torch


def reference_inputs(
    qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    inv_freq: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, H, D], k [T, KVH, D], v [T, KVH, D])`` in fp64: per head RMSNorm with ``(1 + w)``
    rounded to fp16, then the first ``rotary_dim`` features rotated (rotate-half) by the fp32
    angle ``fp32(position) * inv_freq`` (unrounded: compare under a tolerance); v as given."""
    tokens, d = qkv.shape[0], head_dim
    x = qkv.double()
    q = x[:, : 2 * num_heads * d].reshape(tokens, num_heads, 2 * d)[..., :d]
    k = x[:, 2 * num_heads * d : (2 * num_heads + num_kv_heads) * d].reshape(tokens, num_kv_heads, d)
    v = x[:, (2 * num_heads + num_kv_heads) * d :].reshape(tokens, num_kv_heads, d)
    angles = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # the fp32 product
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    half = rotary_dim // 2

    def norm_rope(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())
        y = y.half().double()  # the torch path rounds the norm to the activations' dtype
        y1, y2 = y[..., :half], y[..., half:rotary_dim]
        return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin, y[..., rotary_dim:]), dim=-1)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``got`` (fp16) within fp16 rounding of ``ref`` (fp64): per element ``2e-3 * |ref| +
    4e-3 * rms(ref of its head)`` (an output rounding, and a one-ulp different rounding of
    the normed input that the rotation mixes in). Non-finite values fail."""
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values (unwritten output?)"
    err = (got.double() - ref).abs()
    rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
    excess = err - 2e-3 * ref.abs() - 4e-3 * rms
    worst = int(excess.flatten().argmax())
    assert float(excess.max()) <= 0, (
        f"{what}: outside fp16 rounding of the fp64 reference: max err {float(err.max()):.3e} "
        f"(at flat index {worst}: got {float(got.flatten()[worst]):.5f}, want {float(ref.flatten()[worst]):.5f})"
    )
