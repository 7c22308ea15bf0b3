"""GPU tests of the Gated DeltaNet decode kernel (``gdn_decode.cu``: delta rule and gated
norm) against an fp64 reference and against the runtime's torch step (the path CPU runs keep).

The kernel updates the recurrent states in place in their slots (or writes them to one row
per position): written rows must match the reference within 1e-5 of the state's scale (fp32
math, different summation order), every other row must stay bit-identical, and the fp16
output ``norm_w * rmsnorm(o) * silu(z)`` (poisoned with NaN first) within fp16 rounding:
``|out - ref| <= 4e-3 * |ref| + 2e-3 * rms(ref)``. Measured on an H200 running the
compute_70 PTX before the norm moved into the kernel: the delta rule met the fp64 bounds at
every shape; the torch step differs from it by about 2e-4 of the state's scale, from its fp16
``sigmoid(b)``.

Decode passes above ``gdn.WIDE_ABOVE_ROWS`` rows (with b and a given) run the wide-batch
kernel and then the gated-norm kernel; tests that name a ``path`` force one of the two
(:func:`force_path`) and check which kernels ran, so both stay covered whatever the threshold.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.runtime.engine.graph_capture import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DK = 128
EPS = 1e-6
SHAPES = {"27B": (16, 48, 128), "35B-A3B": (16, 32, 128)}  # key heads, value heads, value head dim
HIDDEN = {"27B": 5120, "35B-A3B": 2048}


def gated_norm_fp64(o, z, norm_w, eps=EPS):
    """fp64 ``norm_w * o / rms(o) * silu(z)`` per value head; ``o [T, Hv, dv]``, ``z [T, >= Hv*dv]``."""
    gate = z[:, : o.shape[1] * o.shape[2]].double().view(o.shape)
    o = o.double()
    return norm_w.double() * o * (o.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * F.silu(gate)


def delta_rule_fp64(mixed, ba, A_log, dt_bias, states, num_k_heads, num_v_heads, dv):
    """fp64: one decode step per sequence (``states`` [B, Hv, DK, dv] are the old states):
    the core output ``o [B, Hv, dv]`` before the norm and the new states."""
    m, ba, states = mixed.double(), ba.double(), states.double()
    batch, key_dim = m.shape[0], num_k_heads * DK
    q = m[:, :key_dim].view(batch, num_k_heads, DK)
    k = m[:, key_dim : 2 * key_dim].view(batch, num_k_heads, DK)
    v = m[:, 2 * key_dim : 2 * key_dim + num_v_heads * dv].view(batch, num_v_heads, dv)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * DK**-0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    repeat = num_v_heads // num_k_heads
    q, k = q.repeat_interleave(repeat, 1), k.repeat_interleave(repeat, 1)
    b, a = ba[:, :num_v_heads], ba[:, num_v_heads : 2 * num_v_heads]
    g = -A_log.double().exp() * F.softplus(a + dt_bias.double())
    beta = torch.sigmoid(b)
    s = states * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def reference(inputs, states, rows, num_k_heads, num_v_heads, dv, project_ba=False):
    """fp64 decode step of ``rows`` (one token per sequence): normed output and new states;
    ``project_ba``: b and a are ``x @ ba_w.T`` (fp64) instead of the ``ba`` rows."""
    if project_ba:
        ba = inputs["x"][rows].double() @ inputs["ba_w"].double().T
    else:
        ba = inputs["ba"][rows]
    o, s = delta_rule_fp64(inputs["mixed"][rows], ba, inputs["A_log"], inputs["dt_bias"], states,
                           num_k_heads, num_v_heads, dv)
    return gated_norm_fp64(o, inputs["z"][rows], inputs["norm_w"]), s


def random_inputs(rows, num_k_heads, num_v_heads, dv, pool, seed, hidden=None):
    """Kernel inputs; with ``hidden``, also a layer input ``x`` (strided rows) and an
    in_proj_ba weight ``ba_w [2*Hv, hidden]`` for the kernel's own projection."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * num_k_heads * DK + num_v_heads * dv

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    extra = {}
    if hidden:
        extra["x"] = randn(rows, hidden + 64).half()[:, :hidden]
        extra["ba_w"] = (randn(2 * num_v_heads, hidden) * 1.5 / hidden**0.5).half()
    return {
        **extra,
        # strided rows, as the runtime passes views of wider projections
        "mixed": randn(rows, width + 40).half()[:, :width],
        "ba": (randn(rows, 2 * num_v_heads + 8) * 2).half(),
        "z": (randn(rows, num_v_heads * dv + 24) * 2).half()[:, : num_v_heads * dv],
        "A_log": torch.rand(num_v_heads, generator=gen, device="cuda").mul(15).add(1).log(),
        "dt_bias": randn(num_v_heads),
        "norm_w": randn(dv) * 0.2 + 1,
        "state": randn(pool, num_v_heads, DK, dv) * 0.3,
        "perm": torch.randperm(pool, generator=gen, device="cuda"),
    }


def run_kernel(inputs, slots, num_k_heads, rows, num_v_heads, dv, dst=None, positions=1, project_ba=False):
    """The kernel on ``inputs`` (state updated in place), its output poisoned with NaN first;
    ``project_ba``: no ``ba`` rows, the kernel projects b and a from ``x`` and ``ba_w``."""
    from onecat.kernels.gdn import gated_delta_rule_decode_

    out = torch.full((rows, num_v_heads, dv), float("nan"), dtype=torch.float16, device="cuda")
    projection = {"hidden_states": inputs["x"], "ba_weight": inputs["ba_w"]} if project_ba else {}
    got = gated_delta_rule_decode_(
        inputs["mixed"], None if project_ba else inputs["ba"], inputs["z"], inputs["A_log"], inputs["dt_bias"],
        inputs["norm_w"], EPS, inputs["state"], slots, num_k_heads, out=out, dst_slots=dst, positions=positions,
        **projection,
    )
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    return out


def force_path(monkeypatch, path):
    """Make every decode pass with b and a given run ``path``: ``"wide"`` (gdn_decode_wide_d*
    then gdn_decode_gated_norm) or ``"fused"`` (gdn_decode_d*), whatever ``WIDE_ABOVE_ROWS``
    says. Returns the list the names of the kernels launched from then on are appended to."""
    from onecat.kernels import gdn

    monkeypatch.setattr(gdn, "WIDE_ABOVE_ROWS", 0 if path == "wide" else 1 << 30)
    launched = []
    real_get_kernel = gdn.get_kernel

    def recording(name, device_index):
        launched.append(name)
        return real_get_kernel(name, device_index)

    monkeypatch.setattr(gdn, "get_kernel", recording)
    return launched


def assert_ran(launched, path):
    wide = [name for name in launched if name.startswith("gdn_decode_wide")]
    fused = [name for name in launched if name.startswith("gdn_decode_d")]
    if path == "wide":
        assert wide and not fused and "gdn_decode_gated_norm" in launched, launched
    else:
        assert fused and not wide, launched


def assert_output_close(out, ref, what):
    assert torch.isfinite(out).all(), f"{what}: unwritten or non-finite outputs"
    err = (out.double() - ref).abs()
    bound = 4e-3 * ref.abs() + 2e-3 * ref.pow(2).mean().sqrt()
    assert (err <= bound).all(), f"{what}: max error {err.max():.2e} (bound at it {bound.flatten()[err.argmax()]:.2e})"


def assert_state_close(got, ref, what):
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-5, f"{what}: relative error {err:.2e}"


CASES = [
    (shape, batch, positions, project_ba)
    for shape in SHAPES
    for batch in (1, 3, 33)
    for positions in (1, 4)
    for project_ba in (False, True)
]


@pytest.mark.parametrize("shape, batch, positions, project_ba", CASES)
def test_gdn_decode_matches_fp64_at_the_real_shapes(shape, batch, positions, project_ba):
    """Both Qwen3.5 shapes: ``positions`` tokens per sequence (1: decoding, in place; 4: a
    verify pass, the state after each position to its own row, the last one the slot, as the
    runner lays them out), each position's output normed and gated; b and a given as rows, or
    projected by the kernel from the layer input (``project_ba``, the model's hidden size)."""
    num_k_heads, num_v_heads, dv = SHAPES[shape]
    rows = batch * positions
    pool = batch * (positions + 1) + 2
    inputs = random_inputs(rows, num_k_heads, num_v_heads, dv, pool, seed=batch * 10 + positions,
                           hidden=HIDDEN[shape])
    slots = inputs["perm"][:batch].contiguous()
    if positions == 1:
        dst = None
        writes = slots
    else:  # position by position: fresh rows, then the slots
        fresh = inputs["perm"][batch : batch * positions]
        dst = torch.cat([fresh, slots]).contiguous()
        writes = dst
    before = inputs["state"].clone()
    out = run_kernel(inputs, slots, num_k_heads, rows, num_v_heads, dv, dst, positions, project_ba)

    untouched = torch.ones(pool, dtype=torch.bool, device="cuda")
    untouched[writes] = False
    assert torch.equal(inputs["state"][untouched], before[untouched]), "rows outside the written ones changed"
    ref_state = before[slots]
    for p in range(positions):
        token = torch.arange(batch, device="cuda") * positions + p
        ref_out, ref_state = reference(inputs, ref_state, token, num_k_heads, num_v_heads, dv, project_ba)
        assert_output_close(out[token], ref_out, f"output at position {p}")
        assert_state_close(inputs["state"][writes[p * batch : (p + 1) * batch]], ref_state, f"state after position {p}")


@pytest.mark.parametrize(
    "batch, num_k_heads, num_v_heads, dv",
    [(1, 16, 48, 128), (5, 8, 24, 128), (8, 16, 32, 128), (3, 2, 4, 64), (2, 4, 4, 32)],
)
def test_gdn_decode_matches_the_torch_step(batch, num_k_heads, num_v_heads, dv):
    """fp64 at the smaller head dims too, and the torch step the runtime runs elsewhere
    (delta rule, then ``gated_rms_norm_math`` on the fp16 core output) agrees with the kernel:
    it rounds ``beta = sigmoid(b)``, ``o`` and the normalised ``o`` to fp16, the kernel keeps
    fp32 up to the output."""
    from onecat.runtime.layers.delta_rule import gated_delta_rule_step
    from onecat.runtime.layers.norm import gated_rms_norm_math
    from onecat.runtime.models.qwen3_5 import decay_and_rate, split_heads

    inputs = random_inputs(batch, num_k_heads, num_v_heads, dv, 11, batch)
    slots = inputs["perm"][:batch].contiguous()
    before = inputs["state"].clone()
    out = run_kernel(inputs, slots, num_k_heads, batch, num_v_heads, dv)
    rows = torch.arange(batch, device="cuda")
    ref_out, ref_state = reference(inputs, before[slots], rows, num_k_heads, num_v_heads, dv)
    assert_output_close(out, ref_out, "output")
    assert_state_close(inputs["state"][slots], ref_state, "state")

    mixed, ba = inputs["mixed"], inputs["ba"]
    b, a = ba[:, :num_v_heads], ba[:, num_v_heads : 2 * num_v_heads]
    q, k, v = split_heads(mixed, num_k_heads, DK, num_v_heads, dv)
    g, beta = decay_and_rate(a, b, inputs["A_log"], inputs["dt_bias"])
    torch_o, torch_s = gated_delta_rule_step(q, k, v, g, beta, before[slots])
    torch_o = torch_o.half()
    torch_out = gated_rms_norm_math(torch_o, inputs["z"].reshape(torch_o.shape), inputs["norm_w"], EPS).float()
    assert (inputs["state"][slots] - torch_s).abs().max() <= 1e-3 * torch_s.abs().max()
    rms = torch_out.pow(2).mean().sqrt()
    assert ((out.float() - torch_out).abs() <= 1e-2 * torch_out.abs() + 1e-2 * rms).all()


def test_gdn_decode_writes_to_destination_slots():
    """Speculative decoding chains positions: read one row, write another; the source rows
    stay as they were."""
    batch, num_k_heads, num_v_heads, dv = 3, 4, 8, 128
    inputs = random_inputs(batch, num_k_heads, num_v_heads, dv, 12, 7)
    src = torch.tensor([0, 5, 2], device="cuda")
    dst = torch.tensor([9, 1, 11], device="cuda")
    before = inputs["state"].clone()
    out = run_kernel(inputs, src, num_k_heads, batch, num_v_heads, dv, dst)
    ref_out, ref_state = reference(inputs, before[src], torch.arange(batch, device="cuda"), num_k_heads,
                                   num_v_heads, dv)
    untouched = torch.ones(inputs["state"].shape[0], dtype=torch.bool, device="cuda")
    untouched[dst] = False
    assert torch.equal(inputs["state"][untouched], before[untouched]), "rows other than the destinations changed"
    assert_state_close(inputs["state"][dst], ref_state, "state")
    assert_output_close(out, ref_out, "output")


@pytest.mark.parametrize("batch, positions", [(3, 3), (2, 5)])
def test_gdn_decode_runs_positions_in_order(batch, positions):
    """A verify pass on a small shape: P tokens per sequence in one launch, the state after
    each written to a fresh row (position by position), the source slots unchanged."""
    num_k_heads, num_v_heads, dv = 4, 8, 64
    rows = batch * positions
    inputs = random_inputs(rows, num_k_heads, num_v_heads, dv, 40, 3 + positions)
    slots = torch.arange(batch, device="cuda") * 2
    dst = torch.arange(positions * batch, device="cuda") + 2 * batch  # [P, B] flattened: fresh rows
    before = inputs["state"].clone()
    out = run_kernel(inputs, slots, num_k_heads, rows, num_v_heads, dv, dst, positions)
    ref_state = before[slots]
    for p in range(positions):
        token = torch.arange(batch, device="cuda") * positions + p
        ref_out, ref_state = reference(inputs, ref_state, token, num_k_heads, num_v_heads, dv)
        assert_state_close(inputs["state"][dst[p * batch : (p + 1) * batch]], ref_state, f"state after position {p}")
        assert_output_close(out[token], ref_out, f"output at position {p}")
    assert torch.equal(inputs["state"][slots], before[slots]), "the source slots changed"


def padded_state_rows(perm, counts, batch, positions):
    """Source slots ``[B]`` and destination rows ``[P][B]`` laid out as
    ``ModelRunner._decode_rows`` and the decode graphs do: sequence ``b`` has ``counts[b]``
    tokens (0: a padding sequence), its state after position ``p < counts[b] - 1`` goes to a
    fresh row, after its last token to its slot; padding rows (positions past the count, and
    padding sequences, which also read it) write one shared scratch row, ``perm[-1]``."""
    scratch = int(perm[-1])
    real = sum(1 for c in counts if c)
    slots = perm[:real].tolist() + [scratch] * (batch - real)
    fresh = iter(perm[real:-1].tolist())
    dst = [[scratch] * batch for _ in range(positions)]
    for b, count in enumerate(counts):
        for p in range(count):
            dst[p][b] = slots[b] if p == count - 1 else next(fresh)
    return slots, dst, scratch


WIDE_CASES = [
    (shape, batch, positions, path)
    for shape in SHAPES
    for batch in (9, 33, 64)
    for positions in (1, 4)
    for path in ("wide", "fused")
]


@pytest.mark.parametrize("shape, batch, positions, path", WIDE_CASES)
def test_gdn_decode_wide_batches_with_padding_rows(monkeypatch, shape, batch, positions, path):
    """Wide batches at both real shapes on each path (forced, so both stay covered whatever the
    threshold): 2 padding sequences sharing a scratch state row, as a decode graph's bucket
    pads; with 4 positions (verify) one sequence has only 2 real tokens, its last 2 rows
    padding. Every real row's output and state against fp64; every row that no real token
    writes, the scratch row aside, bit-identical. Padding rows' outputs are not checked."""
    launched = force_path(monkeypatch, path)
    num_k_heads, num_v_heads, dv = SHAPES[shape]
    rows, padding = batch * positions, 2
    real = batch - padding
    counts = [positions] * real + [0] * padding
    if positions > 1:
        counts[0] = 2
    pool = real * positions + 2  # slots, fresh rows, the scratch row and one row nothing names
    inputs = random_inputs(rows, num_k_heads, num_v_heads, dv, pool, seed=batch * 10 + positions)
    slot_list, dst, scratch = padded_state_rows(inputs["perm"], counts, batch, positions)
    slots = torch.tensor(slot_list, device="cuda")
    dst_flat = None if positions == 1 else torch.tensor([r for pos in dst for r in pos], device="cuda")
    before = inputs["state"].clone()
    out = run_kernel(inputs, slots, num_k_heads, rows, num_v_heads, dv, dst_flat, positions)
    assert_ran(launched, path)

    written = [dst[p][b] for b in range(real) for p in range(counts[b])]
    untouched = torch.ones(pool, dtype=torch.bool, device="cuda")
    untouched[written + [scratch]] = False
    assert untouched.any()
    assert torch.equal(inputs["state"][untouched], before[untouched]), "rows outside the written ones changed"
    ref_state = before[slots[:real]]
    for p in range(positions):
        token = torch.arange(real, device="cuda") * positions + p
        ref_out, ref_state = reference(inputs, ref_state, token, num_k_heads, num_v_heads, dv)
        live = [b for b in range(real) if p < counts[b]]
        assert_output_close(out[token[live]], ref_out[live], f"output at position {p}")
        got_state = inputs["state"][[dst[p][b] for b in live]]
        assert_state_close(got_state, ref_state[live], f"state after position {p}")


@pytest.mark.parametrize("path", ["wide", "fused"])
def test_gdn_decode_replays_in_a_cuda_graph(monkeypatch, path):
    """Captured once at 33 rows (27B shape), replayed after new inputs and new slots were
    copied into its buffers: the replay matches fp64 on the new ones (the path is fixed at
    capture by the row count alone)."""
    from onecat.kernels.gdn import gated_delta_rule_decode_

    launched = force_path(monkeypatch, path)
    num_k_heads, num_v_heads, dv = SHAPES["27B"]
    batch, pool = 33, 70
    inputs = random_inputs(batch, num_k_heads, num_v_heads, dv, pool, seed=5)
    fresh = random_inputs(batch, num_k_heads, num_v_heads, dv, pool, seed=6)
    slots = inputs["perm"][:batch].clone()
    out = torch.empty(batch, num_v_heads, dv, dtype=torch.float16, device="cuda")
    state = inputs["state"]

    def step():
        gated_delta_rule_decode_(inputs["mixed"], inputs["ba"], inputs["z"], inputs["A_log"], inputs["dt_bias"],
                                 inputs["norm_w"], EPS, state, slots, num_k_heads, out=out)

    graph = torch.cuda.CUDAGraph()
    capture(graph, None, step)  # warmed up on the capture stream
    assert_ran(launched, path)
    for name in ("mixed", "ba", "z"):
        inputs[name].copy_(fresh[name])
    slots.copy_(inputs["perm"][pool - batch :])
    out.fill_(float("nan"))
    before = state.clone()
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_state = reference(inputs, before[slots], torch.arange(batch, device="cuda"), num_k_heads,
                                   num_v_heads, dv)
    assert_output_close(out, ref_out, "replayed output")
    assert_state_close(state[slots], ref_state, "replayed state")


def test_gdn_decode_rejects_what_it_cannot_run():
    from onecat.errors import OnecatError
    from onecat.kernels.gdn import gated_delta_rule_decode_

    i = random_inputs(2, 2, 4, 128, 4, 0)
    slots = i["perm"][:2].contiguous()
    args = (i["mixed"], i["ba"], i["z"], i["A_log"], i["dt_bias"], i["norm_w"], EPS)
    with pytest.raises(OnecatError, match="state"):
        gated_delta_rule_decode_(*args, i["state"].half(), slots, 2)
    with pytest.raises(OnecatError, match="slots"):
        gated_delta_rule_decode_(*args, i["state"], slots.int(), 2)
    with pytest.raises(OnecatError, match="norm_weight"):
        gated_delta_rule_decode_(*args[:5], i["norm_w"].half(), EPS, i["state"], slots, 2)
    with pytest.raises(OnecatError, match="z has"):
        gated_delta_rule_decode_(*args[:2], i["z"][:, :100], *args[3:], i["state"], slots, 2)
    with pytest.raises(OnecatError, match="needs hidden_states and ba_weight"):
        gated_delta_rule_decode_(args[0], None, *args[2:], i["state"], slots, 2)
    with pytest.raises(OnecatError, match="ba_weight has"):
        weight = torch.zeros(3, 64, dtype=torch.float16, device="cuda")
        gated_delta_rule_decode_(args[0], None, *args[2:], i["state"], slots, 2, hidden_states=i["mixed"],
                                 ba_weight=weight)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_norm_kernel_matches_fp64(shape, in_place):
    """The gated norm alone (prompt rows): fp64 bounds, output poisoned first (or in place)."""
    from onecat.kernels.gdn import gated_rms_norm_

    _, num_v_heads, dv = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(num_v_heads + in_place)
    tokens = 70
    x = (torch.randn(tokens, num_v_heads, dv, generator=gen, device="cuda") * 0.05).half()
    z = (torch.randn(tokens, num_v_heads * dv + 16, generator=gen, device="cuda") * 2).half()[:, : num_v_heads * dv]
    w = torch.randn(dv, generator=gen, device="cuda") * 0.2 + 1
    ref = gated_norm_fp64(x, z, w)
    out = x.clone() if in_place else torch.full_like(x, float("nan"))
    got = gated_rms_norm_(out if in_place else x, z, w, EPS, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert_output_close(out, ref, "gated norm")


def conv_fp64(x, state, weight, positions):
    """fp64 short conv + SiLU of ``positions`` tokens per sequence (rows sequence-major) from
    ``state [B, C, 3]``: outputs ``[B*P, C]`` and the state after each token ``[P, B, C, 3]``."""
    batch = state.shape[0]
    window = torch.cat([state.double(), x.double().view(batch, positions, -1).transpose(1, 2)], dim=2)
    outs, states = [], []
    for p in range(positions):
        taps = window[:, :, p : p + 4]
        outs.append(F.silu((taps * weight.double()[None]).sum(-1)))
        states.append(window[:, :, p + 1 : p + 4])
    return torch.stack(outs, 1).reshape(batch * positions, -1), torch.stack(states)


@pytest.mark.parametrize("project", [False, True])
@pytest.mark.parametrize("batch, positions, in_place", [(1, 1, True), (5, 1, True), (3, 1, False), (4, 4, False)])
def test_conv_update_matches_fp64(batch, positions, in_place, project):
    """The decode conv kernel: outputs within fp16 rounding of fp64, the states after each
    token exact (they are the inputs), written to their rows (in place, or one row per
    position for verify passes); every other row bit-identical, the output poisoned first.
    With ``project`` the same launch writes in_proj_ba's rows (27B shape: 96 x 5120, strided
    input rows), within fp16 rounding of fp64."""
    from onecat.kernels.gdn import causal_conv1d_update_

    gen = torch.Generator(device="cuda").manual_seed(batch * 10 + positions)
    channels, pool = 2 * 16 * DK + 48 * 128, 3 * batch * positions + 2
    x = torch.randn(batch * positions, channels + 64, generator=gen, device="cuda").half()[:, :channels]
    weight = (torch.randn(channels, 4, generator=gen, device="cuda") * 0.5).half()
    conv_state = torch.randn(pool, channels, 3, generator=gen, device="cuda").half()
    rows = torch.randperm(pool, generator=gen, device="cuda")
    src = rows[:batch].contiguous()
    dst = src if in_place else rows[batch : batch + batch * positions].contiguous()
    before = conv_state.clone()
    out = torch.full((batch * positions, channels), float("nan"), dtype=torch.float16, device="cuda")
    kwargs = {}
    if project:
        hidden = torch.randn(batch * positions, 5120 + 64, generator=gen, device="cuda").half()[:, :5120]
        ba_weight = (torch.randn(96, 5120, generator=gen, device="cuda") * 0.02).half()
        ba = torch.full((batch * positions, 96), float("nan"), dtype=torch.float16, device="cuda")
        kwargs = {"hidden_states": hidden, "ba_weight": ba_weight, "ba_out": ba}
    causal_conv1d_update_(x, conv_state, weight, src, None if in_place else dst, positions, out=out, **kwargs)
    torch.cuda.synchronize()
    if project:
        ref_ba = hidden.double() @ ba_weight.double().T
        assert ((ba.double() - ref_ba).abs() <= 2e-3 * ref_ba.abs() + 1e-3 * ref_ba.pow(2).mean().sqrt()).all()
    ref_out, ref_states = conv_fp64(x, before[src], weight, positions)
    bound = 4e-3 * ref_out.abs() + 2e-3 * ref_out.pow(2).mean().sqrt()
    assert ((out.double() - ref_out).abs() <= bound).all()
    assert torch.equal(conv_state[dst].double(), ref_states.reshape(-1, channels, 3))
    untouched = torch.ones(pool, dtype=torch.bool, device="cuda")
    untouched[dst] = False
    assert torch.equal(conv_state[untouched], before[untouched])


def small_layer(pool):
    """A GDN layer of the tiny config with head dims 128 (2 key heads, 4 value heads) on the
    GPU, random weights, and random conv and recurrent state pools of ``pool`` rows."""
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    raw = _text_kwargs("qwen3_5", 512, 4)
    raw.update(model_type="qwen3_5_text", linear_key_head_dim=DK, linear_value_head_dim=128)
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, "layer", QuantPlan(), torch.float16).cuda()
    for param in layer.parameters():
        param.data.normal_(0, 0.05)
    layer.A_log.data.uniform_(0.5, 1.5)
    layer.norm.weight.data.normal_(1, 0.2)
    assert layer.norm.weight.dtype == torch.float32
    layer.conv_state = torch.randn(pool, layer.conv_dim, 3, device="cuda").half()
    layer.recurrent_state = torch.randn(pool, layer.num_v_heads, DK, 128, device="cuda") * 0.1
    return layer


def assert_layer_close(got, ref, what):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    rms = ref.pow(2).mean().sqrt()
    err = (got - ref).abs()
    assert (err <= 1e-2 * ref.abs() + 1e-2 * rms).all(), f"{what}: max error {err.max():.2e}, rms(ref) {rms:.2e}"


def test_decode_rows_use_the_conv_kernel_and_match_the_torch_step():
    """A GDN layer's decode core on the GPU (conv kernel + delta-rule-and-norm kernel) against
    the torch step the CPU runs (``gated_deltanet_decode``) on the same states; z a strided
    view, as ``project`` splits it off in_proj_qkvz's output."""
    from onecat.runtime.context import ForwardContext, set_context
    from onecat.runtime.models.qwen3_5 import gated_deltanet_decode

    batch = 3
    layer = small_layer(6)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    qkvz = torch.randn(batch, layer.conv_dim + layer.value_dim, device="cuda").half()
    mixed, z = qkvz.split([layer.conv_dim, layer.value_dim], dim=-1)
    ba = torch.randn(batch, 8, device="cuda").half()
    slots = torch.tensor([4, 0, 2], device="cuda")
    set_context(ForwardContext(slot_mapping=slots, num_decodes=batch, decode_state_slots=slots))
    try:
        assert layer._uses_decode_kernel(mixed)
        got = layer.core(mixed, ba, z)
    finally:
        set_context(None)
    b, a = ba.split(4, dim=-1)
    ref, ref_conv, ref_rec = gated_deltanet_decode(
        mixed, b, a, z, conv0, rec0, slots, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight,
        layer.norm.eps, 2, DK, 4, 128,
    )
    assert got.shape == (batch, 4, 128)
    assert_layer_close(got, ref, "decode core")
    assert torch.equal(layer.conv_state[slots], ref_conv.to(torch.float16))
    assert torch.allclose(layer.recurrent_state[slots], ref_rec, atol=1e-2 * ref_rec.abs().max().item())


@pytest.mark.parametrize("path", ["wide", "fused"])
def test_verify_rows_kernel_path_matches_the_torch_path(monkeypatch, path):
    """A speculative verify pass through the layer's core (3 sequences x 4 positions, state
    rows position by position as ``ModelRunner._decode_rows`` lays them out: fresh rows, the
    slot at the last position): one conv and one delta-rule-and-norm launch (or, on the wide
    path, a delta-rule and a norm launch) against the torch step run position after position.
    Every position's output is normed."""
    from onecat.runtime.context import ForwardContext, set_context
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet

    launched = force_path(monkeypatch, path)

    batch, width = 3, 4
    layer = small_layer(20)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    rows = batch * width
    qkvz = torch.randn(rows, layer.conv_dim + layer.value_dim, device="cuda").half()
    mixed, z = qkvz.split([layer.conv_dim, layer.value_dim], dim=-1)
    ba = torch.randn(rows, 8, device="cuda").half()
    slots = [4, 0, 2]
    fresh = [[6 + 3 * j + i for i in range(batch)] for j in range(width - 1)]
    dst_rows = [*fresh, slots]  # position by position
    src_rows = [slots, *fresh]
    dst = torch.tensor([r for pos in dst_rows for r in pos], device="cuda")
    src = torch.tensor([r for pos in src_rows for r in pos], device="cuda")

    def run():
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        ctx = ForwardContext(slot_mapping=torch.zeros(rows, dtype=torch.int64, device="cuda"), num_decodes=rows,
                             decode_state_slots=src, decode_state_dst=dst, decode_width=width)
        set_context(ctx)
        try:
            return layer.core(mixed, ba, z), layer.conv_state, layer.recurrent_state
        finally:
            set_context(None)

    assert layer._uses_decode_kernel(mixed)
    got, got_conv, got_rec = run()
    assert_ran(launched, path)
    monkeypatch.setattr(GatedDeltaNet, "_uses_decode_kernel", lambda self, mixed: False)
    ref, ref_conv, ref_rec = run()
    assert got.shape == (rows, 4, 128)
    for p in range(width):
        assert_layer_close(got[p::width], ref[p::width], f"output at position {p}")
    written = dst.tolist()
    assert torch.equal(got_conv[written], ref_conv[written])
    scale = ref_rec[written].abs().max().item()
    assert torch.allclose(got_rec[written], ref_rec[written], atol=1e-2 * scale)
    untouched = [r for r in range(20) if r not in written]
    assert torch.equal(got_rec[untouched], rec0[untouched])


def test_mixed_step_layer_output_matches_the_torch_norm_paths(monkeypatch):
    """A step of 2 decode rows and 2 prompt chunks through the whole layer (project, core,
    finish): decode rows through the fused kernel, prompt rows through the prefill kernels
    and the gated-norm kernel, against the same step with the torch decode step and the
    torch gated norm (prefill kernels in both). Outputs after out_proj and the state pools."""
    from gdn_prefill_reference import mixed_step_context

    from onecat.kernels import gdn as gdn_kernel
    from onecat.runtime.context import set_context
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet

    layer = small_layer(8)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    decode_slots, lengths, prefill_slots = [5, 1], [7, 66], [3, 6]
    tokens = len(decode_slots) + sum(lengths)
    x = torch.randn(tokens, layer.in_proj_qkvz.in_features, device="cuda").half()

    def run():
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        set_context(mixed_step_context(decode_slots, lengths, prefill_slots, "cuda"))
        try:
            with torch.inference_mode():
                return layer(torch.zeros(tokens, dtype=torch.int64, device="cuda"), x), layer.recurrent_state
        finally:
            set_context(None)

    got, got_rec = run()
    monkeypatch.setattr(GatedDeltaNet, "_uses_decode_kernel", lambda self, mixed: False)
    monkeypatch.setattr(gdn_kernel, "supports_gated_norm", lambda *args: False)
    ref, ref_rec = run()
    assert got.shape == (tokens, layer.out_proj.out_features)
    assert_layer_close(got[: len(decode_slots)], ref[: len(decode_slots)], "decode rows")
    assert_layer_close(got[len(decode_slots) :], ref[len(decode_slots) :], "prompt rows")
    scale = ref_rec.abs().max().item()
    assert torch.allclose(got_rec, ref_rec, atol=1e-2 * scale)


@pytest.mark.parametrize("width", [1, 4])
def test_decode_step_projects_b_and_a_in_the_kernel(monkeypatch, width):
    """A pass of decode rows only through the whole layer (project, core, finish): project
    hands the layer input in place of in_proj_ba's output and the (fused) kernel projects b
    and a; against the torch step with in_proj_ba (outputs after out_proj, state pools).
    On the wide path the conv launch projects them, and the layer's output matches too.
    ``width`` 4: a verify pass (state rows position by position, the slot last)."""
    from onecat.runtime.context import ForwardContext, set_context
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet

    batch = 3
    rows = batch * width
    layer = small_layer(4 + rows)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    x = torch.randn(rows, layer.in_proj_qkvz.in_features, device="cuda").half()
    slots = [3, 0, 2]
    fresh = [[4 + batch * j + i for i in range(batch)] for j in range(width - 1)]
    dst = torch.tensor([r for pos in [*fresh, slots] for r in pos], device="cuda")
    src = torch.tensor([r for pos in [slots, *fresh] for r in pos], device="cuda")

    def run():
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        ctx = ForwardContext(slot_mapping=torch.zeros(rows, dtype=torch.int64, device="cuda"), num_decodes=rows,
                             decode_state_slots=src, decode_state_dst=dst if width > 1 else None,
                             decode_width=width)
        set_context(ctx)
        try:
            with torch.inference_mode():
                (_, ba, _), _ = layer.project(torch.zeros(rows, dtype=torch.int64, device="cuda"), x)
                return ba, layer(torch.zeros(rows, dtype=torch.int64, device="cuda"), x), layer.recurrent_state
        finally:
            set_context(None)

    launched = force_path(monkeypatch, "fused")
    handed, got, got_rec = run()
    assert handed.data_ptr() == x.data_ptr(), "project computed in_proj_ba in a pass of decode rows only"
    assert_ran(launched, "fused")
    launched = force_path(monkeypatch, "wide")
    ran_in_proj_ba = []
    monkeypatch.setattr(layer.in_proj_ba, "forward", lambda *a: ran_in_proj_ba.append(1))
    handed, got_wide, got_wide_rec = run()
    assert handed.data_ptr() == x.data_ptr() and not ran_in_proj_ba, "the wide path ran in_proj_ba"
    assert_ran(launched, "wide")
    monkeypatch.undo()
    monkeypatch.setattr(GatedDeltaNet, "_uses_decode_kernel", lambda self, mixed: False)
    handed, ref, ref_rec = run()
    assert handed.shape == (rows, 8)
    written = dst.tolist() if width > 1 else slots
    scale = ref_rec[written].abs().max().item()
    for what, out, rec in (("fused", got, got_rec), ("wide", got_wide, got_wide_rec)):
        for p in range(width):
            assert_layer_close(out[p::width], ref[p::width], f"{what}: layer output at position {p}")
        assert torch.allclose(rec[written], ref_rec[written], atol=1e-2 * scale), what
