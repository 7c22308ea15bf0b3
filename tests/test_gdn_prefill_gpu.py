"""GPU tests of the Gated DeltaNet prefill kernels (``gdn_prefill.cu``): the chunked delta
rule and the causal conv against fp64 references, against the kernels' own algorithm in
torch (``reference_prefill``, which isolates the fp16 cuts from the CUDA code) and against
the runtime's torch path, in one varlen batch of lengths 1, 63, 64, 65, 300 and 2048 with
non-zero initial states.

Bounds (relative to rms of the reference). The fp16 cuts of the algorithm (fp16 q/k, T, W,
U, state copy, D; see gdn_prefill.cu) measured on the CPU against fp64 (tests/
test_gdn_prefill.py): rms error 5.6e-4 on outputs and 4.3e-4 on states, worst element 6e-3;
the torch fp32 chunked path: 2.9e-4 / 2e-4. The GPU bounds are 4x above that: rms 2e-3,
any element 8e-3 |ref| + 2.5e-2 rms(ref). Slots outside the batch must stay bit-identical and
rows between sequences (poisoned with NaN) unwritten.

Run: ``.venv/bin/python -m pytest -q tests/test_gdn_prefill_gpu.py`` on a CUDA machine
(add ``ONECAT_KERNEL_ARCH=70`` on a newer GPU to run the V100 code).
"""

from __future__ import annotations

import pytest
import torch
from gdn_prefill_reference import (
    DK,
    conv_fp64,
    error_report,
    mixed_step_context,
    random_prefill,
    recurrence_fp64,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
LENGTHS = [1, 63, 64, 65, 300, 2048]
RMS_BOUND = 2e-3


def assert_close(name, got, ref, rms_bound=RMS_BOUND, rel=8e-3, abs_rms=2.5e-2):
    """rms(err) <= rms_bound * rms(ref) and every |err| <= rel |ref| + abs_rms rms(ref)."""
    _, rel_rms, message = error_report(name, got, ref)
    assert torch.isfinite(got).all(), f"{name}: non-finite values ({int((~torch.isfinite(got)).sum())} of them)"
    assert rel_rms <= rms_bound, message
    rms = ref.double().pow(2).mean().sqrt()
    bad = (got.double() - ref.double()).abs() > rel * ref.double().abs() + abs_rms * rms
    assert not bad.any(), f"{int(bad.sum())} elements out of bounds; {message}"


def sequence_rows(starts, lengths):
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]).cuda()


@pytest.mark.parametrize(
    "num_k_heads, num_v_heads, dv",
    [(16, 48, 128), (16, 32, 128), (2, 4, 64), (1, 1, 32)],
)
def test_prefill_matches_fp64_and_the_torch_paths(num_k_heads, num_v_heads, dv):
    from onecat.kernels.gdn_prefill import (
        gated_delta_rule_prefill_,
        prefill_batch,
        reference_prefill,
    )
    from onecat.runtime.layers.delta_rule import gated_delta_rule_chunked
    from onecat.runtime.models.qwen3_5 import decay_and_rate, split_heads

    pool = len(LENGTHS) + 3
    mixed, ba, A_log, dt_bias, state, starts, slots = random_prefill(
        LENGTHS, num_k_heads, num_v_heads, dv, pool, seed=num_v_heads, device="cuda"
    )
    before = state.clone()
    batch = prefill_batch(starts, LENGTHS, slots, torch.device("cuda"))
    out = torch.full((batch.num_tokens, num_v_heads, dv), float("nan"), dtype=torch.float16, device="cuda")
    gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, state, batch, num_k_heads, out=out)
    torch.cuda.synchronize()

    untouched = torch.ones(pool, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(state[untouched], before[untouched]), "slots outside the batch changed"
    rows = sequence_rows(starts, LENGTHS)
    gaps = torch.ones(batch.num_tokens, dtype=torch.bool, device="cuda")
    gaps[rows] = False
    assert out[gaps].isnan().all(), "rows between sequences were written"

    ref_o, ref_s = recurrence_fp64(mixed, ba, A_log, dt_bias, before[slots], starts, LENGTHS, num_k_heads)
    # the kernels' algorithm in torch: tells a CUDA bug (only the kernel is off) from the
    # fp16 cuts (both are off alike)
    alg_state = before.clone()
    alg_o = reference_prefill(mixed, ba, A_log, dt_bias, alg_state, starts, LENGTHS, slots, num_k_heads)
    for i, (start, length) in enumerate(zip(starts, LENGTHS, strict=True)):
        part = slice(start, start + length)
        what = f"sequence {i} (length {length}, slot {slots[i]})"
        hint = error_report("torch algorithm vs fp64", alg_o[part], ref_o[part])[2]
        try:
            assert_close(f"{what} output", out[part], ref_o[part])
            assert_close(f"{what} final state", state[slots[i]], ref_s[i])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n  for comparison, {hint}") from None

    # the runtime's torch chunked path (fp32, beta rounded to fp16) on each sequence
    for i, (start, length) in enumerate(zip(starts, LENGTHS, strict=True)):
        part = slice(start, start + length)
        q, k, v = split_heads(mixed[part], num_k_heads, DK, num_v_heads, dv)
        g, beta = decay_and_rate(ba[part, num_v_heads:], ba[part, :num_v_heads], A_log, dt_bias)
        torch_o, torch_s = gated_delta_rule_chunked(q, k, v, g, beta, before[slots[i]])
        assert_close(f"kernel vs torch chunked path, sequence {i} output", out[part], torch_o, rms_bound=3e-3)
        assert_close(f"kernel vs torch chunked path, sequence {i} state", state[slots[i]], torch_s, rms_bound=3e-3)


def test_prefill_of_one_sequence_in_pieces_continues_its_state():
    """A prompt prefilled as 100 + 1 + 200 tokens (three calls, state carried in the slot)
    equals one call over the 301 tokens."""
    from onecat.kernels.gdn_prefill import gated_delta_rule_prefill_, prefill_batch

    mixed, ba, A_log, dt_bias, state, _, _ = random_prefill([301], 2, 6, 128, 2, seed=5, device="cuda")
    whole = state.clone()
    one = gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, whole, prefill_batch([0], [301], [1], mixed.device), 2)
    pieces = []
    for start, length in [(0, 100), (100, 1), (101, 200)]:
        batch = prefill_batch([0], [length], [1], mixed.device)
        rows = slice(start, start + length)
        pieces.append(gated_delta_rule_prefill_(mixed[rows], ba[rows], A_log, dt_bias, state, batch, 2))
    assert_close("pieces vs whole output", torch.cat(pieces), one)
    assert_close("pieces vs whole state", state[1], whole[1])
    assert torch.equal(state[0], whole[0])


def test_conv_prefill_matches_fp64():
    from onecat.kernels.gdn_prefill import causal_conv1d_prefill_, prefill_batch
    from onecat.runtime.layers.causal_conv import causal_conv1d_chunk

    lengths = [1, 2, 3, 64, 65, 300]
    channels, pool = 2 * 16 * 128 + 48 * 128, len(lengths) + 2
    gen = torch.Generator(device="cuda").manual_seed(3)
    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += n + 2
    x = torch.randn(row, channels + 64, generator=gen, device="cuda").half()[:, :channels]
    weight = (torch.randn(channels, 4, generator=gen, device="cuda") * 0.5).half()
    conv_state = torch.randn(pool, channels, 3, generator=gen, device="cuda").half()
    slots = [5, 0, 7, 2, 3, 1]
    before = conv_state.clone()
    batch = prefill_batch(starts, lengths, slots, x.device)
    out = torch.full((batch.num_tokens, channels), float("nan"), dtype=torch.float16, device="cuda")
    causal_conv1d_prefill_(x, conv_state, weight, batch, out=out)
    torch.cuda.synchronize()

    ref_out, ref_states = conv_fp64(x, before[slots], weight, starts, lengths)
    rows = sequence_rows(starts, lengths)
    err = (out[rows].double() - ref_out[rows]).abs()
    assert (err <= 2e-3 * ref_out[rows].abs() + 2e-3).all(), f"conv output: max error {err.max():.2e}"
    assert torch.equal(conv_state[slots], ref_states.half()), "new conv states are not the last 3 inputs"
    others = [s for s in range(pool) if s not in slots]
    assert torch.equal(conv_state[others], before[others]), "conv states outside the batch changed"
    gaps = torch.ones(batch.num_tokens, dtype=torch.bool, device="cuda")
    gaps[rows] = False
    assert out[gaps].isnan().all(), "rows between sequences were written"
    # and the runtime's torch conv (fp16 math) agrees
    for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        torch_out, _ = causal_conv1d_chunk(x[start : start + length], before[slots[i]], weight)
        diff = (out[start : start + length].float() - torch_out.float()).abs().max()
        assert diff <= 2e-2, f"sequence {i}: kernel vs torch conv differ by {diff:.2e}"


def test_gated_deltanet_layer_kernel_path_matches_torch_path(monkeypatch):
    """The runtime layer (conv, delta rule, gated norm, out_proj) with two decode tokens and
    three prompt chunks in one batch: kernel prefill path vs the torch path, outputs and the
    conv and recurrent state pools."""
    from onecat.kernels import gdn_prefill
    from onecat.runtime.context import set_context
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet
    from onecat.runtime.quant_plan import QuantPlan

    cfg = ModelConfig(
        model_type="qwen3_5_text", vocab_size=512, hidden_size=256, num_hidden_layers=1,
        layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=1e7,
        partial_rotary_factor=0.25, max_position_embeddings=4096, intermediate_size=512,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, "model.layers.0.linear_attn", QuantPlan(), torch.float16).cuda()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name in ("A_log", "dt_bias"):
                continue
            scale = {"norm.weight": 0.1, "conv1d.weight": 0.5}.get(name, 0.05)
            p.copy_(torch.randn_like(p, dtype=torch.float32) * scale + (1.0 if name == "norm.weight" else 0.0))
        layer.A_log.copy_(torch.empty(6).uniform_(0.5, 4.0).log())
        layer.dt_bias.copy_(torch.log(torch.expm1(torch.empty(6).uniform_(-7, -1).exp())))
    slots_total = 8
    conv0 = torch.randn(slots_total, layer.conv_dim, 3, device="cuda").half() * 0.5
    rec0 = torch.randn(slots_total, 6, 128, 128, device="cuda") * 0.1
    lengths, prefill_slots, decode_slots = [5, 70, 130], [4, 1, 6], [2, 7]
    tokens = len(decode_slots) + sum(lengths)
    x = torch.randn(tokens, 256, device="cuda").half()

    def run():
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        set_context(mixed_step_context(decode_slots, lengths, prefill_slots, "cuda"))
        try:
            with torch.inference_mode():
                out = layer(torch.zeros(tokens, dtype=torch.int64, device="cuda"), x)
        finally:
            set_context(None)
        return out, layer.conv_state, layer.recurrent_state

    kernel_out, kernel_conv, kernel_rec = run()
    monkeypatch.setattr(gdn_prefill, "supports", lambda *args: False)
    torch_out, torch_conv, torch_rec = run()
    assert_close("layer output, kernel vs torch prefill path", kernel_out, torch_out, rms_bound=5e-3, rel=2e-2)
    assert torch.equal(kernel_conv, torch_conv), "conv state pools differ"
    assert_close("recurrent state pool, kernel vs torch prefill path", kernel_rec, torch_rec, rms_bound=3e-3)
    untouched = [s for s in range(slots_total) if s not in prefill_slots + decode_slots]
    assert torch.equal(kernel_rec[untouched], rec0[untouched])


def test_prefill_rejects_what_it_cannot_run():
    from onecat.errors import OnecatError
    from onecat.kernels.gdn_prefill import gated_delta_rule_prefill_, prefill_batch

    mixed, ba, A_log, dt_bias, state, starts, slots = random_prefill([10], 2, 4, 128, 2, 0, "cuda")
    batch = prefill_batch(starts, [10], slots, mixed.device)
    with pytest.raises(OnecatError, match="state"):
        gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, state.half(), batch, 2)
    with pytest.raises(OnecatError, match="A_log"):
        gated_delta_rule_prefill_(mixed, ba, A_log.half(), dt_bias, state, batch, 2)
    with pytest.raises(OnecatError, match="value heads a multiple of key heads"):
        gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, state, batch, 3)


@pytest.mark.parametrize("offsets", [(100,), (2, 64, 250), (1, 63, 65, 299)])
def test_checkpoints_inside_a_chunk_hold_the_states_at_their_offsets(offsets):
    """A 301-token prompt prefilled in one call with checkpoints at ``offsets`` (rows 3, 4,
    ...): each checkpoint row holds the conv and recurrent states that a call over the first
    ``offset`` tokens leaves, and the outputs and final states are those of a call without
    checkpoints (the chunks are cut at the offsets, so they agree within fp16 rounding)."""
    from onecat.kernels.gdn_prefill import (
        causal_conv1d_prefill_,
        gated_delta_rule_prefill_,
        prefill_batch,
    )

    mixed, ba, A_log, dt_bias, state, _, _ = random_prefill([301], 2, 6, 128, 3 + len(offsets), seed=11, device="cuda")
    channels = mixed.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(12)
    weight = (torch.randn(channels, 4, generator=gen, device="cuda") * 0.5).half()
    conv_state = torch.randn(state.shape[0], channels, 3, generator=gen, device="cuda").half()
    rows = [3 + i for i in range(len(offsets))]
    state[rows] = float("nan")  # poison: every checkpoint row must be written
    conv_state[rows] = float("nan")
    plain_state, plain_conv = state.clone(), conv_state.clone()
    before_state, before_conv = state.clone(), conv_state.clone()

    plain = prefill_batch([0], [301], [1], mixed.device)
    plain_mixed = causal_conv1d_prefill_(mixed, plain_conv, weight, plain)
    plain_o = gated_delta_rule_prefill_(plain_mixed, ba, A_log, dt_bias, plain_state, plain, 2)
    batch = prefill_batch([0], [301], [1], mixed.device, [list(zip(offsets, rows, strict=True))])
    got_mixed = causal_conv1d_prefill_(mixed, conv_state, weight, batch)
    got_o = gated_delta_rule_prefill_(got_mixed, ba, A_log, dt_bias, state, batch, 2)
    torch.cuda.synchronize()
    assert torch.equal(got_mixed, plain_mixed) and torch.equal(conv_state[1], plain_conv[1])
    assert_close("output with checkpoints", got_o, plain_o)
    assert_close("final state with checkpoints", state[1], plain_state[1])
    assert torch.equal(state[0], before_state[0]) and torch.equal(state[2], before_state[2])
    for offset, row in zip(offsets, rows, strict=True):
        prefix_state, prefix_conv = before_state.clone(), before_conv.clone()
        prefix = prefill_batch([0], [offset], [1], mixed.device)
        prefix_mixed = causal_conv1d_prefill_(mixed[:offset], prefix_conv, weight, prefix)
        gated_delta_rule_prefill_(prefix_mixed, ba[:offset], A_log, dt_bias, prefix_state, prefix, 2)
        assert torch.equal(conv_state[row], prefix_conv[1]), f"conv checkpoint at {offset}"
        assert_close(f"recurrent checkpoint at {offset}", state[row], prefix_state[1])
