"""The gated delta rule of Gated DeltaNet, in torch: a chunked form for prefill and a
one-token recurrent step for decode. CUDA fp16 runs use the sm_70 kernels instead
(``kernels/gdn_decode.cu``, ``kernels/gdn_prefill.cu``); these stay the CPU / fp32 path and
the reference.

Per value head, with state ``S [d_k, d_v]`` (fp32), decay ``g_t <= 0`` (log space) and
learning rate ``beta_t`` in (0, 1), token ``t`` does::

    S   <- exp(g_t) * S                       # forget
    d_t  = beta_t * (v_t - S^T k_t)           # delta: what S mispredicts for k_t
    S   <- S + k_t d_t^T                      # write the correction
    o_t  = S^T q_t

q and k arrive per key head; they are l2-normalised (eps 1e-6 inside the root), q is scaled
by ``d_k ** -0.5``, and each key head serves ``H_v / H_k`` consecutive value heads.

Chunked form (chunk of C tokens, gamma = in-chunk cumulative sum of g, S0 the state at the
chunk start): the deltas solve the unit lower-triangular system ``(I + A) D = B V - W0 S0``
with ``A[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j)`` for ``j < t`` and
``W0 = B K exp(gamma)``; so ``D = U - W S0`` with ``U = (I+A)^-1 B V`` and ``W = (I+A)^-1 W0``
computed for all chunks at once. Then per chunk, in order::

    o = exp(gamma) Q S0 + ((Q K^T) * Decay_causal) D
    S = exp(gamma_C) S0 + (K * exp(gamma_C - gamma))^T D
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def _normalise(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, l2-normalised (eps inside the root), q scaled by ``d_k ** -0.5``."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_normalise`, then key heads repeated to the value heads (head dim -2)."""
    q, k = _normalise(q, k)
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=-2)
        k = k.repeat_interleave(repeat, dim=-2)
    return q, k


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``B`` sequences: ``q, k [B, Hk, dk]``, ``v [B, Hv, dv]``, ``g, beta [B, Hv]``,
    ``state [B, Hv, dk, dv]`` fp32 -> (``o [B, Hv, dv]`` in v's dtype, new state).

    Written as broadcasts and sums (no matmul) so that a compiler fuses it into a pass over
    the state; value heads are viewed as ``[Hk, Hv/Hk]`` instead of repeating q and k.
    """
    batch, num_k_heads, d_k = q.shape
    num_v_heads, d_v = v.shape[-2:]
    group = num_v_heads // num_k_heads
    dtype = v.dtype
    q, k = _normalise(q, k)
    q = q[:, :, None, :, None]  # [B, Hk, 1, dk, 1]
    k = k[:, :, None, :, None]
    state = state.view(batch, num_k_heads, group, d_k, d_v)
    state = state * g.float().exp().view(batch, num_k_heads, group, 1, 1)
    predicted = (state * k).sum(-2)  # [B, Hk, G, dv]
    v = v.float().view(batch, num_k_heads, group, d_v)
    delta = (v - predicted) * beta.float().view(batch, num_k_heads, group, 1)
    state = state + k * delta[:, :, :, None, :]
    out = (state * q).sum(-2)
    return out.reshape(batch, num_v_heads, d_v).to(dtype), state.reshape(batch, num_v_heads, d_k, d_v)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``T`` tokens of one sequence: ``q, k [T, Hk, dk]``, ``v [T, Hv, dv]``, ``g, beta [T, Hv]``,
    ``state [Hv, dk, dv]`` fp32 -> (``o [T, Hv, dv]`` in v's dtype, new state)."""
    length, num_heads, _ = v.shape
    q, k = _prepare(q, k, num_heads)
    pad = (-length) % chunk_size
    # -> [H, N chunks, C, d]; padded tokens have k = v = 0, g = beta = 0 and change nothing
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.float().transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(num_heads, -1, chunk_size, *x.shape[2:])

    q, k, vv, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    gamma = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    log_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = log_decay.exp()  # [H, N, C, C], exp(gamma_t - gamma_j) for j <= t, else 0
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(system, vv * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    state = state.float()
    out = torch.empty_like(u)
    for n in range(u.shape[1]):
        deltas = u[:, n] - w[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + attn[:, n] @ deltas
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ deltas
    out = out.reshape(num_heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
    return out.to(v.dtype).contiguous(), state
