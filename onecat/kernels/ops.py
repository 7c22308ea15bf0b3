"""``torch.ops.onecat.w4a16_linear``: the W4A16 linear as a torch custom op, and
``torch.ops.onecat.w4a16_linear_silu_mul``: a SwiGLU layer's merged gate/up projection
returning ``silu(gate) * up`` (the kernels form it in their epilogue).

- CUDA: picks a kernel variant by M (tuned winner or default, see tuning.py) and launches it
  on torch's current stream.
- CPU: the pure torch reference with the same dequant contract (``dequantize_volta``), then a
  matmul in fp32.
- Meta / fake tensors: shape ``[..., N]`` (``[..., N/2]``) fp16, so torch.compile and CUDA-graph capture can
  trace through the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onecat.errors import OnecatError
from onecat.pack.volta_layout import reference_linear

_ARGS = "(Tensor x, Tensor qweight, Tensor scales_zeros, int group_size, Tensor? bias=None) -> Tensor"

# The Library object must stay alive for the registration to last: module scope.
_LIB = torch.library.Library("onecat", "FRAGMENT")
_LIB.define("w4a16_linear" + _ARGS)
_LIB.define("w4a16_linear_silu_mul" + _ARGS)


def check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
) -> tuple[int, int]:
    """Validate the op's inputs; returns ``(N, K)``.  Raises OnecatError naming the bad field."""
    where = "onecat.kernels.ops.w4a16_linear" + ("_silu_mul" if silu_mul else "")
    if qweight.dtype != torch.int32 or qweight.dim() != 4 or tuple(qweight.shape[2:]) != (32, 4):
        raise OnecatError(
            f"{where}: qweight must be int32 [N/32, K/32, 32, 4] (Volta layout v1), got "
            f"{qweight.dtype} {tuple(qweight.shape)}; pack the checkpoint with `onecat pack`"
        )
    n, k = qweight.shape[0] * 32, qweight.shape[1] * 32
    if silu_mul and n % 64:
        raise OnecatError(
            f"{where}: the merged gate/up weight must have N a multiple of 64 (gate rows, then as "
            f"many up rows, each half whole 32-row tiles), got N={n}"
        )
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise OnecatError(
            f"{where}: group_size {group_size} must be a positive multiple of 32 dividing K={k}"
        )
    expected = (n // 32, k // group_size, 32, 2)
    if scales_zeros.dtype != torch.float16 or tuple(scales_zeros.shape) != expected:
        raise OnecatError(
            f"{where}: scales_zeros must be float16 {list(expected)} for this qweight and group "
            f"size {group_size}, got {scales_zeros.dtype} {tuple(scales_zeros.shape)}"
        )
    if x.dtype != torch.float16:
        raise OnecatError(f"{where}: x must be float16 (V100 has no bf16), got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise OnecatError(f"{where}: x must be [..., {k}], got {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float16 or tuple(bias.shape) != (n,)):
        raise OnecatError(
            f"{where}: bias must be float16 [{n}], got {bias.dtype} {tuple(bias.shape)}"
        )
    tensors = [("x", x), ("qweight", qweight), ("scales_zeros", scales_zeros)]
    if bias is not None:
        tensors.append(("bias", bias))
    for name, t in tensors:
        if t.device != x.device:
            raise OnecatError(f"{where}: {name} is on {t.device}, x on {x.device}")
    for name, t in tensors[1:]:
        if x.device.type == "cuda" and (not t.is_contiguous() or t.data_ptr() % 16):
            raise OnecatError(
                f"{where}: {name} must be contiguous and 16-byte aligned on the GPU "
                f"(call .contiguous() once when loading the weights)"
            )
    return n, k


def _cuda_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    from onecat.kernels import tuning
    from onecat.kernels.variants import run_plan

    # Validation, variant choice and launch parameters are resolved once per signature;
    # per call only what can differ between tensors of one signature is checked (layout,
    # alignment). Keeps a call outside CUDA graphs at a few microseconds of Python.
    signature = (
        x.shape, x.dtype, x.device, qweight.shape, qweight.dtype, qweight.device,
        scales_zeros.shape, scales_zeros.dtype, scales_zeros.device, group_size,
        None if bias is None else (bias.shape, bias.dtype, bias.device), silu_mul,
    )  # fmt: skip
    plan = tuning.remembered_plan(signature)
    if plan is None:
        plan = _resolve(x, qweight, scales_zeros, group_size, bias, silu_mul, signature)
    if not (qweight.is_contiguous() and scales_zeros.is_contiguous()) or (
        qweight.data_ptr() % 16 or scales_zeros.data_ptr() % 16
    ) or (bias is not None and (not bias.is_contiguous() or bias.data_ptr() % 16)):
        check_inputs(x, qweight, scales_zeros, group_size, bias, silu_mul)  # raises with the details
    fused_act = plan is not _NO_ROWS and plan.silu_mul
    n = qweight.shape[0] * 32 // (2 if fused_act else 1)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    out = torch.empty((x2.shape[0], n), dtype=torch.float16, device=x.device)
    if plan is not _NO_ROWS:
        run_plan(plan, x2, qweight, scales_zeros, group_size, bias, out)
    if silu_mul and not fused_act:  # a tensor-core or dequant variant: no SwiGLU epilogue
        out = silu_and_mul(out)
        n //= 2
    return out.view(*x.shape[:-1], n)


_NO_ROWS = object()


def _resolve(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    silu_mul: bool,
    signature: tuple,
) -> object:
    """Validate a new signature and resolve its launch plan (``tuning.plan_signature``,
    which remembers it once the variant choice is final)."""
    from onecat.kernels import tuning

    n, k = check_inputs(x, qweight, scales_zeros, group_size, bias, silu_mul)
    m = x.numel() // k
    if m == 0:
        tuning.remember_plan(signature, _NO_ROWS)
        return _NO_ROWS
    return tuning.plan_signature(signature, m, qweight, scales_zeros, group_size, silu_mul)


def _cpu_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    n, _ = check_inputs(x, qweight, scales_zeros, group_size, bias)
    return reference_linear(x, qweight, scales_zeros, group_size, bias).reshape(*x.shape[:-1], n)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[..., 2I]`` gate/up projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _cuda_silu_mul_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _cuda_impl(x, qweight, scales_zeros, group_size, bias, silu_mul=True)


def _cpu_silu_mul_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    check_inputs(x, qweight, scales_zeros, group_size, bias, silu_mul=True)
    return silu_and_mul(_cpu_impl(x, qweight, scales_zeros, group_size, bias))


_LIB.impl("w4a16_linear", _cuda_impl, "CUDA")
_LIB.impl("w4a16_linear", _cpu_impl, "CPU")
_LIB.impl("w4a16_linear_silu_mul", _cuda_silu_mul_impl, "CUDA")
_LIB.impl("w4a16_linear_silu_mul", _cpu_silu_mul_impl, "CPU")


@torch.library.register_fake("onecat::w4a16_linear")
def _fake_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    n = qweight.shape[0] * 32
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("onecat::w4a16_linear_silu_mul")
def _fake_silu_mul_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    n = qweight.shape[0] * 16
    return x.new_empty((*x.shape[:-1], n))


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` with a 4-bit weight ``W [N, K]`` in the Volta layout (v1).

    Args:
        x: activations, float16 ``[..., K]``, on the weight's device.  Any strides; a
            non-contiguous or misaligned ``x`` is copied once.
        qweight: int32 ``[N/32, K/32, 32, 4]``, contiguous, 16-byte aligned (``pack_volta``).
        scales_zeros: float16 ``[N/32, K/g, 32, 2]``, the half2 ``(s, fp16(-z*s))`` per column
            and group, contiguous.
        group_size: quantization group ``g`` along K (a multiple of 32 dividing K).
        bias: optional float16 ``[N]``, added in fp32 before the final rounding.

    Returns:
        float16 ``[..., N]``.  Weights are dequantised as ``fp16(q*s + nzs)`` (one rounding)
        and products are summed in fp32 (the GEMV first forms fp16 partial sums of 8 products).

    Raises:
        OnecatError: on a wrong dtype, shape, device, or non-contiguous weights.
    """
    return torch.ops.onecat.w4a16_linear(x, qweight, scales_zeros, group_size, bias)


def packed_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`w4a16_linear` for any activation dtype; what the runtime and the vLLM plugin call.

    fp16 activations go to the op (the sm_70 kernels on a GPU, the reference on the CPU).
    Other dtypes exist only on the CPU (fp32 runs compared with transformers, bf16 for
    vLLM's CPU backend) and use the same reference, returning ``x.dtype``: the dequantised
    weights are identical either way. A non-fp16 ``x`` on a GPU is an error.
    """
    if x.dtype != torch.float16 and x.device.type == "cpu":
        return reference_linear(x, qweight, scales_zeros, group_size, bias)
    if x.is_cuda and not torch.compiler.is_compiling():
        # the op's CUDA implementation without the dispatcher's round trip (same code)
        return _cuda_impl(x, qweight, scales_zeros, group_size, bias)
    return w4a16_linear(x, qweight, scales_zeros, group_size, bias)


def packed_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` of a SwiGLU layer's merged gate/up projection in one op
    (``torch.ops.onecat.w4a16_linear_silu_mul``), for any activation dtype as
    :func:`packed_linear`.

    ``qweight`` holds the gate rows then as many up rows (``N`` a multiple of 64); the result
    is ``[..., N/2]``, the same values as ``silu_and_mul(packed_linear(...))`` (fp16: silu
    rounded to fp16, then the product). On the GPU a GEMV variant (the tuned choice for a
    few rows) forms it in its epilogue, so no activation kernel runs; with the tensor-core
    and dequant variants the activation follows the projection (:func:`fuses_silu_mul`).
    """
    if x.dtype != torch.float16 and x.device.type == "cpu":
        return silu_and_mul(reference_linear(x, qweight, scales_zeros, group_size, bias))
    if x.is_cuda and not torch.compiler.is_compiling():
        return _cuda_impl(x, qweight, scales_zeros, group_size, bias, silu_mul=True)
    return torch.ops.onecat.w4a16_linear_silu_mul(x, qweight, scales_zeros, group_size, bias)


def fuses_silu_mul(rows: int, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`packed_linear_silu_mul` of ``rows`` activation rows runs ONE launch on the
    GPU: the variant chosen for that many rows (``tuning.choose_variant``, resolved once and
    remembered) is a GEMV, whose epilogue applies the activation. Otherwise a caller does
    better to run :func:`packed_linear` and its own fused activation kernel."""
    if not qweight.is_cuda or rows <= 0:
        return False
    from onecat.kernels import tuning

    return tuning.choose_variant(rows, qweight, scales_zeros, group_size).fuses_silu_mul(qweight.shape[0] * 32)
