"""fp64 references and inputs shared by the GDN prefill tests (CPU and GPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DK = 128


def random_prefill(lengths, num_k_heads, num_v_heads, dv, pool, seed, device, gap=3):
    """fp16 ``mixed`` / ``ba`` rows for sequences of ``lengths`` laid out one after another
    (``gap`` unused rows between them), gates spanning slow and fast decays, and a pool of
    non-zero fp32 states. Returns (mixed, ba, A_log, dt_bias, state, starts, slots)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += n + gap
    width = 2 * num_k_heads * DK + num_v_heads * dv
    # strided rows, as the runtime's views of wider projections
    mixed = torch.randn(row, width + 8, generator=gen, device=device).half()[:, :width]
    ba = torch.randn(row, 2 * num_v_heads, generator=gen, device=device).half()
    # exp(A_log) in [0.5, 4]; softplus(a + dt_bias) mostly 0.001 .. 0.5: per-token decays from
    # about 0.999 (memory across many chunks) to 0.2
    A_log = torch.empty(num_v_heads, device=device).uniform_(0.5, 4.0, generator=gen).log()
    dt = torch.empty(num_v_heads, device=device).uniform_(-7.0, -1.0, generator=gen).exp()
    dt_bias = torch.log(torch.expm1(dt))
    state = torch.randn(pool, num_v_heads, DK, dv, generator=gen, device=device) * 0.1
    slots = torch.randperm(pool, generator=gen, device=device)[: len(lengths)].tolist()
    return mixed, ba, A_log, dt_bias, state, starts, slots


def recurrence_fp64(mixed, ba, A_log, dt_bias, states, starts, lengths, num_k_heads):
    """The gated delta rule token by token in fp64, all sequences in lockstep.
    ``states [B, Hv, DK, dv]`` are the initial states of the sequences (not modified).
    Returns (o fp64 ``[rows, Hv, dv]`` (rows outside sequences zero), final states fp64)."""
    batch, num_v_heads, _, dv = states.shape
    m, gates = mixed.double(), ba.double()
    key_dim = num_k_heads * DK
    rows_total = m.shape[0]
    q = m[:, :key_dim].view(rows_total, num_k_heads, DK)
    k = m[:, key_dim : 2 * key_dim].view(rows_total, num_k_heads, DK)
    v = m[:, 2 * key_dim : 2 * key_dim + num_v_heads * dv].view(rows_total, num_v_heads, dv)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * DK**-0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    group = num_v_heads // num_k_heads
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    g = -A_log.double().exp() * F.softplus(gates[:, num_v_heads : 2 * num_v_heads] + dt_bias.double())
    beta = torch.sigmoid(gates[:, :num_v_heads])
    s = states.double().clone()
    out = torch.zeros(rows_total, num_v_heads, dv, dtype=torch.float64, device=m.device)
    start_t = torch.tensor(starts, device=m.device)
    length_t = torch.tensor(lengths, device=m.device)
    for i in range(max(lengths)):
        active = length_t > i
        rows = torch.where(active, start_t + i, start_t)
        s_new = s * g[rows].exp()[..., None, None]
        delta = beta[rows][..., None] * (v[rows] - torch.einsum("bhkv,bhk->bhv", s_new, k[rows]))
        s_new = s_new + k[rows][..., :, None] * delta[..., None, :]
        o = torch.einsum("bhkv,bhk->bhv", s_new, q[rows])
        s = torch.where(active[:, None, None, None], s_new, s)
        out[rows[active]] = o[active]
    return out, s


def conv_fp64(x, states, weight, starts, lengths):
    """The causal depthwise conv + SiLU per sequence in fp64: (out ``[rows, C]`` (rows outside
    sequences zero), new states ``[B, C, K-1]``)."""
    kernel = weight.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    new_states = []
    for b, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        window = torch.cat((states[b].double(), x[start : start + length].double().t()), dim=1)
        y = F.conv1d(window[None], weight.double()[:, None, :], groups=weight.shape[0])[0]
        out[start : start + length] = F.silu(y).t()
        new_states.append(window[:, -(kernel - 1) :])
    return out, torch.stack(new_states)


def error_report(name, got, ref):
    """(max relative-to-rms error, rms error / rms ref, a message naming the worst element)."""
    got, ref = got.double(), ref.double()
    err = (got - ref).abs()
    rms = ref.pow(2).mean().sqrt().item()
    worst = int(err.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    rel_rms = err.pow(2).mean().sqrt().item() / max(rms, 1e-30)
    message = (
        f"{name}: rms(err)/rms(ref) = {rel_rms:.2e}, max err {err.max().item():.3e} at {index} "
        f"(got {got.flatten()[worst].item():.5f}, ref {ref.flatten()[worst].item():.5f}, "
        f"rms(ref) {rms:.3e})"
    )
    return err.max().item() / max(rms, 1e-30), rel_rms, message


def chunk_count(lengths, chunk=64):
    """Chunks of 64 tokens over these sequences."""
    return sum(math.ceil(n / chunk) for n in lengths)


def mixed_step_context(decode_slots: list[int], lengths: list[int], prefill_slots: list[int], device):
    """The ``ForwardContext`` of one step of decode rows (state slots ``decode_slots``) then
    prompt chunks of ``lengths`` (fresh sequences in ``prefill_slots``), laid out one after
    another, as the runner builds it (KV slots unused: GDN layers only)."""
    from onecat.runtime.context import ForwardContext, PrefillChunk

    prefills, start = [], len(decode_slots)
    for length, slot in zip(lengths, prefill_slots, strict=True):
        prefills.append(PrefillChunk(start, length, 0, torch.zeros(1, dtype=torch.int64, device=device), slot))
        start += length
    return ForwardContext(
        slot_mapping=torch.zeros(start, dtype=torch.int64, device=device), prefills=prefills,
        num_decodes=len(decode_slots), decode_state_slots=torch.tensor(decode_slots, device=device),
    )
